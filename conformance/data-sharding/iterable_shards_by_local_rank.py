"""A streaming dataset picks its shard with trainer.local_rank: on two nodes both nodes read the same shard.

The user's DataModule builds a sharded stream the way GPU data pipelines are configured (shard_id, num_shards):
`shard_id=self.trainer.local_rank`, `num_shards=self.trainer.world_size`. On one node local_rank equals the
global rank, so the shards are disjoint and nothing looks wrong. On two nodes with one process each, both
processes have local_rank 0: both read shard 0 of 2, shard 1 is never read, and every step's global batch is one
local batch seen twice. No error and no warning; the report found it because only a quarter of the data was ever
seen in a 4-node run (8 of 32 shards, each read 4 times).
Fix: shard by the global rank (`self.trainer.global_rank`), and keep local_rank for the local device index only.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, IterableDataset

SOURCE = "https://github.com/NVIDIA-BioNeMo/nvSubquadratic/pull/107"
EXPECTED = {"data-sharding": "fail", "sync-dist": "pass", "unused-parameters": "pass"}
EVIDENCE = ("ShardedStream is built with shard_id=trainer.local_rank (0 on node 0 and on node 1) and "
            "num_shards=world_size=2: global ranks 0 and 1 both yield records [0, 2, 4, ...]; records "
            "[1, 3, 5, ...] are never read. Shard by global_rank")
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
        # the pipeline's "shard_id": local to the node, not global
        self.train_set = ShardedStream(shard_id=self.trainer.local_rank, num_shards=self.trainer.world_size)

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
        print("CASE: rank", self.global_rank, "node", self.trainer.node_rank, "local_rank", self.local_rank,
              "epoch", self.current_epoch, "record ids", sorted(self.seen), flush=True)
        self.seen = []

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"max_epochs": 1, "limit_train_batches": 1.0}
