"""The index-list sampler of ok_index_list_sampler_by_rank built without the rank: every rank fetches every list.

The library's sampler defaults to rank=0, world=1, and the user builds it as `ListSampler(64, 4)`. With
use_distributed_sampler=False nothing else splits the data, so both ranks fetch the same index lists in the same
order (the sampler is seeded by its epoch only). The batches are slotted objects a checker cannot read into; the
index lists __getitem__ receives show the fault. Fix: pass the rank and world size to the sampler.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

SOURCE = "variant (issue 19, section 3: index-list samplers)"
EXPECTED = {"data-sharding": "fail"}
EVIDENCE = "rank 0 and rank 1 fetch the same index lists at every step"


class Rows:
    __slots__ = ("x", "y")

    def __init__(self, x, y):
        self.x, self.y = x, y


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
        return ListSampler(64, 4)  # the rank and world size are left at their defaults

    def train_dataloader(self):
        return DataLoader(Table(64, 5), sampler=self._sampler(), batch_size=None, collate_fn=lambda b: b)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"use_distributed_sampler": False}
