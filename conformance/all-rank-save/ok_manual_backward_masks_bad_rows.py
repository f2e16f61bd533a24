"""CONFORMING twin of manual_backward_skipped_on_one_rank: the bad micro-batch is masked, every rank steps.

Same manual optimization and the same missing label on rank 1's shard, but the step masks the rows whose target
is NaN (a batch without valid rows contributes a loss of 0 times the prediction) instead of returning, so every
rank runs the backward and its gradient all-reduce in every step.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "conforming (fix of manual_backward_skipped_on_one_rank)"
EXPECTED = {"all-rank-save": "pass", "unused-parameters": "pass", "effective-batch": "nofail"}
EVIDENCE = "passes: every rank runs the backward of every step"


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
        valid = ~torch.isnan(y).squeeze(1)
        pred = self.net(x)
        # masked, not skipped: every rank runs the backward (an all-NaN batch gives a loss of 0)
        loss = torch.nn.functional.mse_loss(pred[valid], y[valid]) if valid.any() else pred.sum() * 0.0
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()

    def train_dataloader(self):
        return DataLoader(_rows(32, 1), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
