"""CONFORMING: setup() writes a small per-process file (its pid in the name): no evaluation output, no shared file.

The module records which process ran which stage in `worker-<pid>.json`, written in setup(), before any batch
of the stage runs: each rank writes its own file and none holds outputs of the stage. A rank-0 file is an
evaluation output only when written from the stage's outputs, during or after the stage; this one must not be
reported as "written by rank 0 alone from rank 0's shard" (a field trial's false FAILED).
"""
import json
import os

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "issue 38 (a field trial's false FAILED on a per-rank file written in setup)"
EXPECTED = {"eval-duplication": "pass", "shared-writes": "pass"}
EVIDENCE = "passes: the files setup() writes hold no outputs of the stage"


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x[:, :2].sum(1, keepdim=True))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(6, 1)

    def setup(self, stage):
        with open(f"worker-{os.getpid()}.json", "w") as fh:
            json.dump({"stage": stage, "pid": os.getpid()}, fh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True, batch_size=len(y))

    def train_dataloader(self):
        return DataLoader(_rows(32, 1), batch_size=4)

    def val_dataloader(self):
        return DataLoader(_rows(64, 2), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
