"""CONFORMING: HYBRID_SHARD for a job of 2 nodes x 2 devices: shard within each node, replicate across nodes.

The Trainer config asks FSDPStrategy(sharding_strategy="HYBRID_SHARD") with an auto_wrap_policy that names the
block the model repeats, and num_nodes=2, devices=2: each node holds one replica sharded over its two devices, and
gradients are all-reduced across the nodes. The one-node items shard it within one node; the [fsdp-2nodes] items
run it across nodes (on a layout of one rank per node as FULL_SHARD over all ranks, which the item says).
"""
import lightning.pytorch as L
import torch
import torch.nn as nn
from lightning.pytorch.strategies import FSDPStrategy
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed (FSDP section: HYBRID_SHARD shards within node groups and replicates across them)"
EXPECTED = {"strategy-config": "pass", "all-rank-save": "pass", "sync-dist": "pass", "shared-writes": "pass"}
EVIDENCE = ""
NODES = 2


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        return x + self.ff(x)


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(29)
        x = torch.randn(32, 8, generator=g)
        return DataLoader(TensorDataset(x, x.cos()), batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(8), Block(8))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.blocks(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def trainer_kwargs():
    return {"strategy": FSDPStrategy(sharding_strategy="HYBRID_SHARD", auto_wrap_policy={Block}),
            "num_nodes": 2, "devices": 2}
