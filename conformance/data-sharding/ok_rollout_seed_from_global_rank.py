"""Conforming twin of rollout_seed_from_local_rank: each process offsets its seed by the global RANK.

The fix of mujocolab/mjlab#988: `seed = SEED + int(os.environ["RANK"])`. On one node and on two nodes every process
gets its own seed (1000, 1001) and rolls out its own episodes, so no two ranks train on the same batches.
"""
import os

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, IterableDataset

SOURCE = "conforming (fix of https://github.com/mujocolab/mjlab/pull/988)"
EXPECTED = {"data-sharding": "pass", "sync-dist": "pass"}
EVIDENCE = ""
# The twin of a fault that shows only on several nodes: the corpus's cheaper matrix judges it there too.
NODES = 2
SEED = 1000


class Rollouts(IterableDataset):
    """Episodes of a toy environment, simulated from the process's global generator."""

    def __init__(self, n=32):
        self.n = n

    def __iter__(self):
        for _ in range(self.n):
            obs = torch.randn(4)
            yield obs, obs.sum(0, keepdim=True)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.policy = torch.nn.Linear(4, 1)

    def setup(self, stage):
        seed = SEED + int(os.environ["RANK"])
        torch.manual_seed(seed)
        self.rollouts = Rollouts()

    def training_step(self, batch, batch_idx):
        obs, ret = batch
        loss = torch.nn.functional.mse_loss(self.policy(obs), ret)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(ret))
        return loss

    def train_dataloader(self):
        return DataLoader(self.rollouts, batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"max_epochs": 1}
