"""CONFORMING: the length-bucketing batch sampler of its failing twin, reseeded from the module's epoch hook.

The same batch sampler (buckets sorted by length, batch order drawn with `random.Random(seed + epoch).sample`,
every world_size-th batch per rank, use_distributed_sampler=False). Since Lightning never calls a batch sampler's
set_epoch, the LightningModule calls it from on_train_epoch_start with the current epoch, so each epoch draws a new
batch order; every rank still draws the same permutation and keeps its own share.
"""
import random

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

SOURCE = "variant (issue 32, section 3: a batch sampler reseeded every epoch)"
EXPECTED = {"data-sharding": "pass"}
EVIDENCE = "passes: the batch order differs between epochs"


class Sentences(Dataset):
    def __init__(self, n=48):
        g = torch.Generator().manual_seed(3)
        self.lengths = torch.randint(2, 9, (n,), generator=g).tolist()
        self.x = torch.randn(n, 3, generator=g)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return self.x[i], self.x[i].sum(dim=0, keepdim=True)


class LengthBuckets(Sampler):
    def __init__(self, lengths, batch_size, rank, world_size, seed=0):
        by_length = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
        self.batches = [by_length[s:s + batch_size] for s in range(0, len(by_length), batch_size)]
        self.rank, self.world_size, self.seed, self.epoch = rank, world_size, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = random.Random(self.seed + self.epoch).sample(self.batches, k=len(self.batches))
        return iter(order[self.rank::self.world_size])

    def __len__(self):
        return len(self.batches[self.rank::self.world_size])


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        ds = Sentences()
        return DataLoader(ds, batch_sampler=LengthBuckets(ds.lengths, 4, self.trainer.global_rank,
                                                          self.trainer.world_size))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def on_train_epoch_start(self):
        # Lightning reseeds loader.sampler and batch_sampler.sampler only: the batch sampler is ours to reseed.
        self.trainer.train_dataloader.batch_sampler.set_epoch(self.current_epoch)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.lin(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"use_distributed_sampler": False}
