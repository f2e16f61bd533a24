"""`setup()` writes a data index to node-local temp storage on the global rank zero only, and every rank reads it.

A common pattern: the index (or a tokenised cache) is built in `setup()` under `if self.trainer.is_global_zero:`,
followed by a barrier, into `tempfile.gettempdir()`. On one node every rank sees the file; on two nodes node 1's
`/tmp` has no such file and its ranks raise FileNotFoundError. prepare_data_per_node does not help: it places
prepare_data only, and this file is written in setup.
Fix: write the index to storage every node mounts, or write it on each node's local rank 0 (then barrier).
"""
import json
import os
import tempfile

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

SOURCE = "https://lightning.ai/docs/pytorch/stable/data/datamodule.html#setup"
EXPECTED = {"node-local-files": "fail"}
EVIDENCE = ("global rank 0 (node 0) wrote <gettempdir>/index_cache/index.json in DataModule.setup; global rank 1 "
            "(node 1) opened the same path: FileNotFoundError")
NODES = 2


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    return TensorDataset(x, x[:, :1] - x[:, 1:2])


class DataModule(L.LightningDataModule):
    def setup(self, stage=None):
        path = os.path.join(tempfile.gettempdir(), "index_cache", "index.json")
        if self.trainer.is_global_zero:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as fh:
                json.dump(list(range(24)), fh)
        self.trainer.strategy.barrier()
        with open(path) as fh:
            self.index = json.load(fh)

    def train_dataloader(self):
        return DataLoader(Subset(_data(32, 71), self.index), batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(5, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
