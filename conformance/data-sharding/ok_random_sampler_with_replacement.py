"""CONFORMING: RandomSampler(replacement=True), sharded by Lightning: repeated indices are sampling, not a fault.

The user bootstraps: each epoch draws len(dataset) indices with replacement. Lightning wraps the sampler in its
DistributedSamplerWrapper, so each rank takes a disjoint slice of one draw, re-drawn every epoch. The same index can
appear twice on one rank or on both ranks by design; counts are equal (4 batches per rank).
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

SOURCE = "issue 11"
EXPECTED = {"data-sharding": "pass"}
EVIDENCE = "4 batches per rank per epoch; repeats of an index come from replacement=True"


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return torch.nn.functional.mse_loss(self.lin(x), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(7)
        x = torch.randn(12, 3, generator=g)
        ds = TensorDataset(x, x.sum(dim=1, keepdim=True), torch.arange(12))
        return DataLoader(ds, batch_size=2, sampler=RandomSampler(ds, replacement=True, num_samples=16))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
