"""A sampler the user owns splits the dataset unevenly: rank 0 gets 20 samples (5 batches), rank 1 gets 16 (4).

With use_distributed_sampler=False the user shards by contiguous blocks sized by a weight per rank. A run capped at
4 batches per epoch (limit_train_batches=4) runs 4 steps on both ranks, so the counts alone look even; in production
rank 0's fifth step all-reduces with rank 1's first step of the next epoch and the world hangs at the end.
Fix: equal shards (DistributedSampler(drop_last=True)) or stop all ranks after the smallest shard.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

SOURCE = "issue 11"
EXPECTED = {"data-sharding": "fail"}
EVIDENCE = "len(train DataLoader): rank 0 has 5 batches, rank 1 has 4, although the capped run ran 4 on each"


class WeightedBlocks(Sampler):
    def __init__(self, n, rank, weights=(5, 4)):
        size = n * weights[rank] // sum(weights)
        start = sum(n * w // sum(weights) for w in weights[:rank])
        self.indices = list(range(start, start + size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.lin(x), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(6)
        x = torch.randn(36, 3, generator=g)
        ds = TensorDataset(x, x.sum(dim=1, keepdim=True))
        return DataLoader(ds, batch_size=4, sampler=WeightedBlocks(len(ds), self.global_rank))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"use_distributed_sampler": False}
