"""CONFORMING: a corrupt sample that only one rank draws is masked out of the loss, so every rank runs backward.

Twin of training_step_none_on_one_rank.py: the same corrupt sample 3 in one rank's batch, but training_step keeps
the step and drops the bad rows from the loss (a zero loss that still depends on the parameters when no row is
left), so every rank runs backward and DDP's gradient all-reduce pairs on every step.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "conforming"
EXPECTED = {"unused-parameters": "pass"}
EVIDENCE = "every rank runs backward on every batch; the corrupt row is masked out of rank 1's loss"


def _data():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 4, generator=g)
    y = (x[:, 0] > 0).long()
    y[3] = -1  # a corrupt sample: one rank's batch holds it
    return TensorDataset(x, y)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        keep = y >= 0  # drop corrupt rows, keep the step: every rank must run backward
        logits = self.net(x)
        if not keep.any():
            return (logits * 0).sum()
        return torch.nn.functional.cross_entropy(logits[keep], y[keep])

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=2, shuffle=False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
