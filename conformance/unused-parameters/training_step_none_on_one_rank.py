"""training_step returns None for a corrupt batch, which only one rank draws: that rank skips DDP's gradient all-reduce.

A common guard skips a batch the loss cannot use (`if bad: return None`). Lightning then skips backward and the
optimizer step for that batch, but only on the rank that returned None: under DDP the other rank's backward waits
in the gradient all-reduce for a partner that never comes, and the skipping rank's next forward finds the previous
iteration's reduction unfinished (DDP: "Expected to have finished reduction in the prior iteration"), or, with
buckets that happen to pair, averages gradients of different steps (Lightning 2.6 refuses the None under DDP and
stops the run). Here sample 3 is corrupt (label -1) and only one rank's batch holds it. Fix: keep the step and mask
the bad samples out of the loss so every rank runs backward.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "Lightning-AI/pytorch-lightning discussions: returning None from training_step under DDP (issue #19)"
EXPECTED = {"unused-parameters": "fail"}
EVIDENCE = ("training_step returned None on one rank only (at the file:line of its return), the other rank's "
            "backward waits in DDP's gradient all-reduce")


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
        if (y < 0).any():
            return None  # skip the corrupt batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=2, shuffle=False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
