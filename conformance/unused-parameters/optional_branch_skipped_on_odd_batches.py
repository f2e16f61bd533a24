"""An auxiliary head only takes part on even batches, under DDP's default find_unused_parameters=False.

The model adds an auxiliary reconstruction loss every other batch (a common "cheap regulariser" trick).
On odd batches aux_head produces nothing that reaches the loss, so its parameters get no gradient in that
backward; DDP (find_unused_parameters=False) waits for them and the next step fails. Usage really is dynamic
here, so the fix is find_unused_parameters=True (or computing the auxiliary loss on every batch, weighted 0
when it should not count), not freezing the head.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"


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
        if batch_idx % 2 == 0:  # the auxiliary loss only on even batches
            loss = loss + 0.1 * torch.nn.functional.mse_loss(self.aux_head(h), x)
        return loss

    def train_dataloader(self):
        return DataLoader(_split(64, 1), batch_size=8, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


EXPECTED = {"unused-parameters": "fail", "all-rank-save": "pass"}
EVIDENCE = ("aux_head.weight, aux_head.bias get no gradient on odd batches only (epoch 0 batch 1, batch 3, ...) "
            "under find_unused_parameters=False: usage is dynamic, so set find_unused_parameters=True")
