"""CONFORMING: a package-owned sampler yields lists of indices, split by rank; the dataset returns a slotted batch.

Some libraries fetch a whole batch in one call: the DataLoader gets `sampler=` a sampler yielding index lists and
`batch_size=None`, so __getitem__ receives a list, and the dataset returns its own batch object (here a class with
__slots__, no __dict__, so nothing outside it can walk its fields). The sampler takes the rank and world size and
hands each rank every world-size-th list; use_distributed_sampler=False, since it shards itself. A checker that
reads samples off batch tensors reads nothing here and must not call that a pass: the samples are the indices the
dataset receives.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

SOURCE = "variant (issue 19, section 3: index-list samplers)"
EXPECTED = {"data-sharding": "pass"}
EVIDENCE = "passes: rank 0 fetches index lists 0, 2, 4, ..., rank 1 lists 1, 3, 5, ..."


class Rows:
    __slots__ = ("x", "y")

    def __init__(self, x, y):
        self.x, self.y = x, y

    def to(self, device):  # Lightning moves a batch object that has .to() to the rank's device
        return Rows(self.x.to(device), self.y.to(device))


class Table(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, rows):
        return Rows(self.x[rows], self.y[rows])


class ListSampler(Sampler):
    """Shuffled lists of `size` indices; each rank takes every world-size-th list."""

    def __init__(self, n, size, rank=0, world=1):
        self.n, self.size, self.rank, self.world, self.epoch = n, size, rank, world, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _lists(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        return [order[i:i + self.size] for i in range(0, self.n, self.size)]

    def __iter__(self):
        yield from self._lists()[self.rank::self.world]

    def __len__(self):
        return len(self._lists()[self.rank::self.world])


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.net(batch.x), batch.y)

    def _sampler(self):
        return ListSampler(64, 4, self.global_rank, self.trainer.world_size)

    def train_dataloader(self):
        return DataLoader(Table(64, 5), sampler=self._sampler(), batch_size=None, collate_fn=lambda b: b)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"use_distributed_sampler": False}
