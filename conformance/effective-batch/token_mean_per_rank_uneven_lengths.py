"""Each rank divides its summed token loss by its own token count; ranks hold sequences of different lengths.

A sequence model pads to 8 tokens and averages the loss over the valid tokens of the local batch. Lightning's
DistributedSampler deals even-indexed sequences (8 valid tokens, small errors) to rank 0 and odd-indexed ones (1
valid token, large errors) to rank 1. DDP then averages two per-rank means: a token on rank 1 weighs 8 times more
than a token on rank 0, and the step differs from the one the same 8 sequences give on one device.
Fix: all-reduce the token count and divide the summed loss by the global count (times the world size, since DDP
averages), or weight each rank's mean by its token share.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"effective-batch": "fail", "sync-dist": "pass"}
EVIDENCE = ("first-step gradient on 2 ranks x batch 4 differs from 1 rank x batch 8 on the same samples by a factor "
            "that is not the world size; the loss divides by a local count (mask.sum())")

SEQ, DIM = 8, 3


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, SEQ, DIM, generator=g)
    y = x.sum(dim=2)
    mask = torch.zeros(n, SEQ)
    for i in range(n):
        if i % 2 == 0:
            mask[i] = 1.0
        else:
            mask[i, 0] = 1.0
            y[i] = y[i] * 6.0  # the short sequences are the hard ones
    return TensorDataset(x, y, mask)


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(_data(16, seed=37), batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(DIM, 1)

    def training_step(self, batch, batch_idx):
        x, y, mask = batch
        err = (self.proj(x).squeeze(-1) - y) ** 2
        loss = (err * mask).sum() / mask.sum()
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
