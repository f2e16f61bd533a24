"""prepare_data runs once in the whole job (prepare_data_per_node=False) but writes into node-local /tmp.

The user sets `prepare_data_per_node = False` ("download once, not once per node") and lets prepare_data fetch and
preprocess the corpus into a cache under tempfile.gettempdir(). setup() then loads that file on every rank. On one
node this is right. On two nodes only global rank 0 (node 0) runs prepare_data, so the cache exists on node 0's
local disk only, and setup() on node 1 raises FileNotFoundError; node 0 then waits for a peer that died.
The flag and the storage must agree: once per job needs a directory every node mounts, node-local storage needs
once per node. The report: datasets downloaded "only on node 0, rank 0" with no shared filesystem; the fix was
to download on each node's local rank 0.
Fix: keep prepare_data_per_node=True (the default) for node-local caches, or write the cache to shared storage.
"""
import os
import tempfile
import time

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "https://github.com/pytorch/ignite/issues/1922"
EXPECTED = {"node-local-files": "fail", "shared-writes": "pass", "unused-parameters": "pass"}
EVIDENCE = ("prepare_data (prepare_data_per_node=False: global rank 0 only) wrote <gettempdir>/toy_corpus/"
            "train.pt on node 0's local storage; setup() on global rank 1 (node 1) opened the same path: "
            "FileNotFoundError. Write it to shared storage or prepare once per node")
# The fault shows only on a world of several nodes: the corpus's cheaper matrix judges it there too.
NODES = 2


def _cache_path():
    return os.path.join(tempfile.gettempdir(), "toy_corpus", "train.pt")


class DataModule(L.LightningDataModule):
    def __init__(self):
        super().__init__()
        self.prepare_data_per_node = False  # "the download is big, do it once"

    def prepare_data(self):
        path = _cache_path()
        if os.path.exists(path):
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        g = torch.Generator().manual_seed(31)
        x = torch.randn(48, 6, generator=g)
        time.sleep(0.2)  # stands for the download
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
