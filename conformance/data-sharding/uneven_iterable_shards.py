"""An IterableDataset splits its records between ranks unevenly: rank 0 gets 12 records, rank 1 gets 8.

The user shards a stream by contiguous blocks sized by a weight per rank. Each rank trains on its own records,
but rank 0 runs 3 batches of 4 per epoch and rank 1 runs 2. Every training step all-reduces gradients, so rank
0's third step pairs with rank 1's first step of the next epoch, and at the end one rank waits in a collective
the other never enters. Fix: give every rank the same number of batches (equal shards, or stop all ranks after
the smallest shard).
"""
import lightning.pytorch as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

SOURCE = "seed"
EXPECTED = {"data-sharding": "fail"}
EVIDENCE = "epoch 0: rank 0 ran 3 train batches, rank 1 ran 2; the world desyncs and hangs"

WEIGHTS = (3, 2)


class WeightedBlocks(IterableDataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __iter__(self):
        rank = dist.get_rank() if dist.is_initialized() else 0
        size = len(self.y) * WEIGHTS[rank] // sum(WEIGHTS)
        start = sum(len(self.y) * w // sum(WEIGHTS) for w in WEIGHTS[:rank])
        for i in range(start, start + size):
            yield self.x[i], self.y[i]


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(WeightedBlocks(20, seed=9), batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.lin(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
