"""Manual optimization returns early on a batch with a missing label: that rank skips the gradient all-reduce.

The user trains with `automatic_optimization = False` and skips any micro-batch whose targets hold a NaN (a
label missing in the source data) with `return None` before `self.manual_backward(loss)`. Only one rank's shard
holds the bad row, so that rank leaves the training step without the backward while the other rank waits in
DDP's gradient all-reduce, which never pairs up: the world hangs. The report blamed the rank that behaved ("rank 0
hung in backward"); the cause is the rank whose collective sequence came up short, at its `return`.
Fix: let the bad batch contribute nothing on every rank (mask it, or multiply its loss by 0), or decide to skip
on every rank together.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "issue 38 (a field trial's rebuilt report of manual optimization skipping a micro-batch on one rank)"
EXPECTED = {"all-rank-save": "fail", "unused-parameters": "nofail"}
EVIDENCE = ("rank 1 left training_step without the backward rank 0 ran in the same step, returning under "
            "`if torch.isnan(y).any():` before the backward")


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = x[:, :2].sum(1, keepdim=True)
    y[5] = float("nan")  # a missing label: the shard of rank 1 holds it (index 5 of 32)
    return TensorDataset(x, y)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = torch.nn.Linear(6, 1)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        if torch.isnan(y).any():
            return None  # skip the bad micro-batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()

    def train_dataloader(self):
        return DataLoader(_rows(32, 1), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
