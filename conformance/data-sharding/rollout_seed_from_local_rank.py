"""Each process seeds its own rollouts from LOCAL_RANK: on two nodes both processes roll out the same episodes.

Rebuilt from the fix in mujocolab/mjlab#988 ("Fix multi-node distributed training using duplicate seeds across
nodes"): the training script offsets every process's seed by `int(os.environ["LOCAL_RANK"])`, for "diversity in
different processes". LOCAL_RANK is the rank within the node, so on one node the seeds are 1000 and 1001 and each
process simulates its own episodes; on two nodes with one process each both processes have LOCAL_RANK 0, seed
1000, and roll out the same episodes: the world trains on one node's experience twice. Nothing splits the data
here (each process generates its own); the seed is what collides. Fix: offset the seed by the global RANK.
"""
import os

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, IterableDataset

SOURCE = "https://github.com/mujocolab/mjlab/pull/988"
EXPECTED = {"data-sharding": "fail", "sync-dist": "pass"}
EVIDENCE = ("global ranks 0 (node 0) and 1 (node 1) both call torch.manual_seed(1000) from "
            "`seed = SEED + int(os.environ[\"LOCAL_RANK\"])` (local rank 0 on each node), so both roll out the same "
            "episodes; derive the seed from the global rank")
# The fault shows only on a world of several nodes: the corpus's cheaper matrix judges it there too.
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
        seed = SEED + int(os.environ["LOCAL_RANK"])
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
