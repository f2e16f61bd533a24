"""A conforming two-node torchrun launch: `torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0|1
--master-addr node0 --master-port 29400 train.py` on each node, and a Trainer with num_nodes=2, devices=2.

LAUNCH_ENV is what torchrun gives each of the four processes (two per node). WORLD_SIZE 4 = 2 x 2, every rank
has the same MASTER_ADDR/MASTER_PORT, GROUP_RANK is 0 on one node and 1 on the other, and the process-group
timeout is set on the strategy. Every contract must pass.
"""
from datetime import timedelta

import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"launch-env": "pass", "sync-dist": "pass", "all-rank-save": "pass"}
EVIDENCE = "torchrun launch of 2 node(s) x 2 process(es) matches the Trainer: WORLD_SIZE=4 = num_nodes 2 x devices 2"


def _env(rank):
    return {"TORCHELASTIC_RUN_ID": "job-17", "RANK": str(rank), "LOCAL_RANK": str(rank % 2), "WORLD_SIZE": "4",
            "GROUP_RANK": str(rank // 2), "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2",
            "MASTER_ADDR": "node0", "MASTER_PORT": "29400"}


LAUNCH_ENV = {0: [_env(0), _env(1)], 1: [_env(2), _env(3)]}  # node rank -> its processes' environments


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.lin(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def train_dataloader(self):
        g = torch.Generator().manual_seed(7)
        x = torch.randn(32, 4, generator=g)
        return DataLoader(TensorDataset(x, x[:, :1] + x[:, 2:3]), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"num_nodes": 2, "devices": 2, "strategy": DDPStrategy(timeout=timedelta(minutes=20))}
