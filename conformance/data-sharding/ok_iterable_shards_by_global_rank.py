"""Conforming twin of iterable_shards_by_local_rank: the stream is sharded by the global rank.

Same pipeline-style DataModule (shard_id, num_shards), with shard_id=self.trainer.global_rank. On one node and on
two nodes the two ranks read disjoint halves of the 32 records, each record once per epoch. local_rank is not used
for data at all (it is only right for picking the local device).
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, IterableDataset

SOURCE = "conforming (fix of https://github.com/NVIDIA-BioNeMo/nvSubquadratic/pull/107)"
EXPECTED = {"data-sharding": "pass", "sync-dist": "pass", "unused-parameters": "pass", "node-local-files": "pass"}
EVIDENCE = ""
# The fault shows only on a world of several nodes: the corpus's cheaper matrix judges it there too.
NODES = 2


class ShardedStream(IterableDataset):
    def __init__(self, shard_id, num_shards, n=32):
        g = torch.Generator().manual_seed(707)
        self.x = torch.randn(n, 4, generator=g)
        self.shard_id, self.num_shards = shard_id, num_shards

    def __iter__(self):
        for i in range(self.shard_id, len(self.x), self.num_shards):
            yield i, self.x[i], self.x[i].sum(0, keepdim=True)


class DataModule(L.LightningDataModule):
    def setup(self, stage):
        self.train_set = ShardedStream(shard_id=self.trainer.global_rank, num_shards=self.trainer.world_size)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.reg = torch.nn.Linear(4, 1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        ids, x, y = batch
        self.seen += ids.tolist()
        loss = torch.nn.functional.mse_loss(self.reg(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def on_train_epoch_end(self):
        print("CASE: rank", self.global_rank, "node", self.trainer.node_rank, "epoch", self.current_epoch,
              "record ids", sorted(self.seen), flush=True)
        self.seen = []

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"max_epochs": 1, "limit_train_batches": 1.0}
