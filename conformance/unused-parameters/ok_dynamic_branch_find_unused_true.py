"""CONFORMING: a branch that really is skipped on some steps, with find_unused_parameters=True.

Same auxiliary head as optional_branch_skipped_on_odd_batches, but the trainer config asks DDP to look for
unused parameters (strategy="ddp_find_unused_parameters_true"). aux_head misses a gradient on odd batches and
gets one on even batches, so the flag is needed and its graph traversal is not wasted: a checker must pass
unused-parameters here (neither a failure nor the "flag is wasted" advisory).
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "conforming"


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, :2].sum(1) > 0).long())


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU())
        self.head = torch.nn.Linear(16, 2)
        self.aux_head = torch.nn.Linear(16, 6)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.encoder(x)
        loss = torch.nn.functional.cross_entropy(self.head(h), y)
        if batch_idx % 2 == 0:
            loss = loss + 0.1 * torch.nn.functional.mse_loss(self.aux_head(h), x)
        return loss

    def train_dataloader(self):
        return DataLoader(_split(64, 1), batch_size=8, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def trainer_kwargs():
    return {"strategy": "ddp_find_unused_parameters_true"}


EXPECTED = {"unused-parameters": "pass", "all-rank-save": "pass"}
EVIDENCE = ("passes: aux_head.* skip the odd batches' backward passes and find_unused_parameters=True is set, "
            "which dynamic usage needs")
