"""FSDPStrategy(device_mesh=(2, 8)) for a job whose nodes have 4 devices: every shard group crosses nodes.

The user copied the mesh from a cluster of 8-GPU nodes ("2 replicas of 8-way sharding") onto a job of
num_nodes=4, devices=4. The mesh still spans the 16 ranks, so init_device_mesh accepts it, but its shard dimension
(8) is larger than a node (4 devices): each FSDP all-gather and reduce-scatter of every forward and backward goes
over the inter-node network, which hybrid sharding exists to avoid. No error; the job is just slow. Lightning builds
the mesh with init_device_mesh("cuda", ...), so a CPU run cannot build it: judged from the config.
Fix: device_mesh=(num_nodes, devices) = (4, 4), shard within each node.
"""
import lightning.pytorch as L
import torch
import torch.nn as nn
from lightning.pytorch.strategies import FSDPStrategy
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed (FSDP section: HYBRID_SHARD shards within node groups and replicates across them)"
EXPECTED = {"strategy-config": "fail"}
EVIDENCE = "device_mesh=(2, 8) shards over groups of 8 ranks, but a node has devices=4"


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        return x + self.ff(x)


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(31)
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
    return {"strategy": FSDPStrategy(sharding_strategy="HYBRID_SHARD", auto_wrap_policy={Block}, device_mesh=(2, 8)),
            "num_nodes": 4, "devices": 4}
