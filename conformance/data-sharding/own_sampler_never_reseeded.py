"""A user-owned shuffling sampler shards by rank but draws the same permutation every epoch.

With use_distributed_sampler=False the user writes a sampler that shuffles with a fixed seed and gives each rank
every world_size-th index. Sharding is right, but the generator is seeded in __iter__ with the same seed every
time and the sampler has no set_epoch, so every epoch replays the same batches in the same order.
Fix: implement set_epoch(epoch) (Lightning calls it every epoch) and seed with seed + epoch.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

SOURCE = "seed"
EXPECTED = {"data-sharding": "fail", "sync-dist": "pass"}
EVIDENCE = ("train sampler ShuffledShard gives rank 0 and rank 1 the same sample order in epoch 0 and epoch 1 "
            "(shuffled once, never reseeded)")


class ShuffledShard(Sampler):
    def __init__(self, n, rank, world, seed=7):
        self.n, self.rank, self.world, self.seed = n, rank, world, seed

    def __iter__(self):
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed)).tolist()
        return iter(perm[self.rank::self.world])

    def __len__(self):
        return len(range(self.rank, self.n, self.world))


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(5)
        x = torch.randn(32, 3, generator=g)
        ds = TensorDataset(x, x.sum(dim=1, keepdim=True))
        return DataLoader(ds, batch_size=4, sampler=ShuffledShard(len(ds), self.trainer.global_rank,
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
