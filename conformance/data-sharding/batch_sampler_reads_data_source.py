"""A bucketing batch sampler reads `self.sampler.data_source`, which Lightning's DistributedSampler lacks.

The user groups samples of similar length with a BatchSampler subclass that looks up lengths through the wrapped
sampler's `data_source` (a RandomSampler has it). On 2 ranks Lightning re-creates the batch sampler around its
DistributedSampler, which stores the dataset as `.dataset`; the first epoch fails with an AttributeError on every
rank. Fix: take the dataset from the constructor (or `sampler.dataset`), or own the sampling with
use_distributed_sampler=False and a rank-aware sampler.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

SOURCE = "issue"
EXPECTED = {"data-sharding": "fail"}
EVIDENCE = ("AttributeError: 'DistributedSampler' object has no attribute 'data_source' at "
            "batch_sampler_reads_data_source.py:21 (__iter__), on every rank")


class LengthBuckets(BatchSampler):
    def __iter__(self):
        lengths = self.sampler.data_source.tensors[0].abs().sum(dim=1)
        order = sorted(self.sampler, key=lambda i: float(lengths[i]))
        for start in range(0, len(order), self.batch_size):
            yield order[start:start + self.batch_size]


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(4)
        x = torch.randn(32, 3, generator=g)
        ds = TensorDataset(x, x.sum(dim=1, keepdim=True))
        return DataLoader(ds, batch_sampler=LengthBuckets(RandomSampler(ds), batch_size=4, drop_last=False))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.lin(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
