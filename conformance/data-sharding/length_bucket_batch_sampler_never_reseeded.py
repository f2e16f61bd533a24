"""A length-bucketing batch sampler shuffles with a seed that never changes: nothing calls its set_epoch.

With use_distributed_sampler=False the user's own batch sampler groups indices of similar length into batches
(built once, sorted by length), shuffles the batch order with `random.Random(seed + epoch).sample` and keeps every
world_size-th batch for this rank. It has a set_epoch(epoch), as DistributedSampler does, but Lightning calls
set_epoch on the DataLoader's sampler and on the batch sampler's .sampler only, never on the batch sampler itself;
so epoch stays 0 and every epoch replays the same batches in the same order. Sharding by rank is right, so only the
order across epochs shows it: judged from the indices each epoch handed the dataset.
Fix: count the epoch in __iter__, or call set_epoch from on_train_epoch_start.
"""
import random

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

SOURCE = "variant (issue 32, section 3: a batch sampler never reseeded; length bucketing)"
EXPECTED = {"data-sharding": "fail", "sync-dist": "pass"}
EVIDENCE = ("the train batch sampler `LengthBuckets` gives every rank the same sample order in epoch 0 and epoch 1 "
            "(the same dataset keys per rank); `LengthBuckets has set_epoch(epoch), which nothing called`: Lightning "
            "calls set_epoch on `the DataLoader's sampler and on its batch sampler's .sampler only`")


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

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.lin(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"use_distributed_sampler": False}
