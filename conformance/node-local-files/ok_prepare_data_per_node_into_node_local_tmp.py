"""Conforming twin of prepare_data_once_into_node_local_tmp: a node-local cache, prepared once per node.

prepare_data_per_node stays True (Lightning's default), so local rank 0 of every node fills its own node's
<gettempdir>/toy_corpus/train.pt, and setup() on each rank reads the copy on its own node. One writer per node-local
directory, no rank reads a file another node wrote. Correct on one node and on many, with or without a shared
filesystem.
"""
import os
import tempfile
import time

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "conforming (fix of https://github.com/pytorch/ignite/issues/1922)"
EXPECTED = {"node-local-files": "pass", "shared-writes": "pass", "unused-parameters": "pass",
            "data-sharding": "pass"}
EVIDENCE = ""
# The fault shows only on a world of several nodes: the corpus's cheaper matrix judges it there too.
NODES = 2


def _cache_path():
    return os.path.join(tempfile.gettempdir(), "toy_corpus", "train.pt")


class DataModule(L.LightningDataModule):
    def __init__(self):
        super().__init__()
        self.prepare_data_per_node = True  # node-local cache: each node prepares its own

    def prepare_data(self):
        path = _cache_path()
        if os.path.exists(path):
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        g = torch.Generator().manual_seed(31)
        x = torch.randn(48, 6, generator=g)
        time.sleep(0.2)
        torch.save({"x": x, "y": x[:, :3].sum(1, keepdim=True)}, path)
        print("CASE: rank", self.trainer.global_rank, "node", self.trainer.node_rank, "prepared", path, flush=True)

    def setup(self, stage):
        path = _cache_path()
        print("CASE: rank", self.trainer.global_rank, "node", self.trainer.node_rank, "setup opens", path,
              "exists:", os.path.exists(path), flush=True)
        blob = torch.load(path)
        self.train_set = TensorDataset(blob["x"], blob["y"])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=6, shuffle=True)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.reg = torch.nn.Linear(6, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.reg(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"max_epochs": 1}
