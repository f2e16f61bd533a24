"""HYBRID_SHARD on nodes of one device each: every node trains its own replica, the nodes never synchronise.

The Trainer config asks FSDPStrategy(sharding_strategy="HYBRID_SHARD") (an auto_wrap_policy names the repeated
block) for a job of num_nodes=2, devices=1: "shard within the node, replicate across nodes". With one device per
node each shard group is one rank, and torch FSDP turns a group of one into NO_SHARD over that group: the
gradients are reduced within the node only, never across nodes, so the two nodes' weights drift apart with no
error (measured on torch 2.13, two single-rank nodes: the ranks' weights differ after 8 steps).
Fix: with one device per node use FULL_SHARD (or SHARD_GRAD_OP, or DDP) over all ranks.
"""
import lightning.pytorch as L
import torch
import torch.nn as nn
from lightning.pytorch.strategies import FSDPStrategy
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed (FSDP section: HYBRID_SHARD shards within node groups and replicates across them)"
EXPECTED = {"strategy-config": "fail", "sync-dist": "pass"}
EVIDENCE = "HYBRID_SHARD with one device per node (devices=1): each node's shard group is one rank"
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
            "num_nodes": 2, "devices": 1}
