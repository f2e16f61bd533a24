"""A user-owned shuffling sampler has its own reseed method, but not under the name Lightning calls.

With use_distributed_sampler=False the sampler shards by rank and draws its permutation from a seed it
keeps; it offers `shuffle(epoch)` to draw a new one, which nothing calls: Lightning calls only
`set_epoch(epoch)` on a sampler at every epoch start. Every epoch replays the same batches. A checker
must name the method the user wrote and say that Lightning calls only set_epoch, not that the sampler
has no way to reseed. Fix: name it set_epoch (or add a set_epoch that calls it).
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

SOURCE = "issue 32 (a field trial's sampler, rebuilt)"
EXPECTED = {"data-sharding": "fail", "sync-dist": "pass"}
EVIDENCE = "ReshuffledShard's own `shuffle(epoch)` is named; Lightning calls only 'set_epoch'"


class ReshuffledShard(Sampler):
    def __init__(self, n, rank, world, seed=7):
        self.n, self.rank, self.world, self.seed = n, rank, world, seed
        self.order = self._draw(0)

    def _draw(self, epoch):
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def shuffle(self, epoch):
        self.order = self._draw(epoch)

    def __iter__(self):
        return iter(self.order[self.rank::self.world])

    def __len__(self):
        return len(range(self.rank, self.n, self.world))


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(5)
        x = torch.randn(32, 3, generator=g)
        ds = TensorDataset(x, x.sum(dim=1, keepdim=True))
        return DataLoader(ds, batch_size=4, sampler=ReshuffledShard(len(ds), self.trainer.global_rank,
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
