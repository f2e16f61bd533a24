"""The test loss is synced across ranks, but 9 test samples on 2 ranks put one sample in twice.

test_step logs a per-sample mean loss with sync_dist=True and batch_size, which is the documented way to
get an epoch mean over ranks. The test set has 9 samples; Lightning's DistributedSampler pads the test set
too (to 10, repeating index 0), so the synced test_loss averages 10 evaluations and differs from a
one-device test on the same weights. Fix: a non-padding test sampler (or dedupe by id), or test on one device.
"""
import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
PLAIN_DRIVER = "fit,test"


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x @ torch.tensor([1.0, -2.0, 0.5, 0.0]) + 3.0)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x).squeeze(1), y)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self.net(x).squeeze(1), y), sync_dist=True, batch_size=len(y))

    def train_dataloader(self):
        return DataLoader(_split(32, 1), batch_size=8)

    def test_dataloader(self):
        return DataLoader(_split(9, 2), batch_size=5)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


EXPECTED = {"eval-duplication": "fail", "sync-dist": "pass", "unused-parameters": "pass"}
EVIDENCE = ("test sample index 0 evaluated on rank 0 and rank 1: 10 evaluations for 9 samples; test_loss on 2 ranks "
            "differs from the 1-device value on the same weights")
