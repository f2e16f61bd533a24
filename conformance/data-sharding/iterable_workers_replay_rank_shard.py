"""An IterableDataset shards by rank but not by DataLoader worker; the loader runs 2 workers.

Each rank keeps every world_size-th record, which is right for num_workers=0. With num_workers=2 the dataset is
copied into both worker processes and each copy yields the whole rank shard again, so every record reaches the
rank twice per epoch (and the epoch is twice as long). Fix: also split by get_worker_info(): keep record i when
i % (world * workers) == rank * workers + worker_id.
"""
import lightning.pytorch as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

SOURCE = "seed"
EXPECTED = {"data-sharding": "fail"}
EVIDENCE = ("`every rank (0 and 1)` saw its samples more than once in epoch 0 (DataLoader num_workers=2: each worker "
            "replays the stream): every rank that shows it is named, with evidence for each")


class RankShardedStream(IterableDataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __iter__(self):
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        for i in range(rank, len(self.y), world):
            yield self.x[i], self.y[i]


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(RankShardedStream(32, seed=41), batch_size=4, num_workers=2)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.lin(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
