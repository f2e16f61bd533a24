"""CONFORMING under DDP: the optimizer holds the head's parameters only, the backbone gets gradients but is never
stepped (a linear-probe setup that forgot to freeze the backbone, costing only its gradient memory).

Every parameter gets a gradient on every step, so DDP with find_unused_parameters=False is right. The Trainer config
names no sharded strategy. Under FSDP, resuming from a sharded checkpoint refuses an optimizer that covers part of
the parameters ("... is not in the optimizer state"): that is what would break on a move to FSDP, to be said as such,
never an all-rank-save failure.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"all-rank-save": "pass", "unused-parameters": "pass", "sync-dist": "pass", "data-sharding": "pass",
            "shared-writes": "pass"}
EVIDENCE = "all-rank-save passes under FSDP and names the sharded resume's refusal as an FSDP incompatibility"


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, :3].sum(1) > 0).long())


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
        self.head = torch.nn.Linear(16, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.head(self.backbone(x)), y)

    def train_dataloader(self):
        return DataLoader(_rows(32, 4), batch_size=4, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.head.parameters(), lr=1e-2)
