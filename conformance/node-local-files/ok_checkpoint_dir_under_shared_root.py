"""Conforming twin of checkpoint_dir_under_node_local_tmp: checkpoints go to the shared run directory.

Same ModelCheckpoint and the same RestoreBest callback, with dirpath left to Lightning
(`<default_root_dir>/checkpoints`, here on storage every node mounts). Global rank 0 writes the file once; every
rank of every node then opens the same best_model_path and finds it.
"""
import os

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "conforming (fix of https://github.com/Lightning-AI/pytorch-lightning/issues/18812)"
EXPECTED = {"node-local-files": "pass", "all-rank-save": "pass", "sync-dist": "pass", "shared-writes": "pass"}
EVIDENCE = ""
# The fault shows only on a world of several nodes: the corpus's cheaper matrix judges it there too.
NODES = 2


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > x[:, 1]).long())


class RestoreBest(L.Callback):
    def on_fit_end(self, trainer, pl_module):
        best = trainer.checkpoint_callback.best_model_path
        print("CASE: rank", trainer.global_rank, "node", trainer.node_rank, "loads", os.path.basename(best),
              "exists:", os.path.exists(best), flush=True)
        state = torch.load(best, map_location="cpu", weights_only=False)["state_dict"]
        pl_module.load_state_dict(state)


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(_data(32, 61), batch_size=4, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_data(16, 62), batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True, batch_size=len(y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def trainer_kwargs():
    return {"enable_checkpointing": True,
            "callbacks": [ModelCheckpoint(monitor="val_loss", save_top_k=1), RestoreBest()]}
