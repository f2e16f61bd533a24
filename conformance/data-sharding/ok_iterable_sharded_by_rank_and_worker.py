"""CONFORMING: an IterableDataset that shards its stream by rank and DataLoader worker.

Each of the 2 ranks runs 2 workers; record i goes to the one (rank, worker) pair with
i % (world * workers) == rank * workers + worker_id, so every record is trained on exactly once per epoch and
every rank gets the same number of batches.
"""
import lightning.pytorch as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

SOURCE = "seed"
EXPECTED = {"data-sharding": "pass", "shared-writes": "pass", "sync-dist": "pass", "effective-batch": "pass",
            "spawn-safety": "pass", "strategy-config": "pass"}
EVIDENCE = "ranks draw disjoint records with the same number of batches per epoch"


class ShardedStream(IterableDataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __iter__(self):
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for i in range(len(self.y)):
            if i % (world * workers) == rank * workers + worker:
                yield self.x[i], self.y[i], i


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(ShardedStream(64, seed=8), batch_size=4, num_workers=2)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        loss = torch.nn.functional.mse_loss(self.lin(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
