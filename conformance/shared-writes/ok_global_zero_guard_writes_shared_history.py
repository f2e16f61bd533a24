"""Conforming twin of local_rank_guard_writes_shared_history: the shared write is guarded by is_global_zero.

Same history file in the shared run directory, written from on_validation_epoch_end under
`if self.trainer.is_global_zero:`. Exactly one process in the job writes it, on one node or on many; the file has
one row per epoch. The value is the synced val_loss, so which rank writes does not change the content.
"""
import os

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "conforming (fix of https://github.com/NVIDIA/DeepLearningExamples/issues/1092)"
EXPECTED = {"shared-writes": "pass", "sync-dist": "pass", "unused-parameters": "pass", "node-local-files": "pass"}
EVIDENCE = ""
# The fault shows only on a world of several nodes: the corpus's cheaper matrix judges it there too.
NODES = 2


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    return TensorDataset(x, x[:, :1] - x[:, 1:2])


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(_data(32, 51), batch_size=4, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_data(8, 52), batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.mlp(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.mlp(x), y), sync_dist=True, batch_size=len(y))

    def on_validation_epoch_end(self):
        if self.trainer.sanity_checking:
            return
        if self.trainer.is_global_zero:
            path = os.path.join(self.trainer.default_root_dir, "val_history.csv")
            with open(path, "a") as fh:
                fh.write(f"{self.current_epoch},{float(self.trainer.callback_metrics['val_loss']):.6f}\n")

    def on_fit_end(self):
        self.trainer.strategy.barrier()
        if self.trainer.is_global_zero:
            with open(os.path.join(self.trainer.default_root_dir, "val_history.csv")) as fh:
                rows = fh.read().splitlines()
            print("CASE: val_history.csv has", len(rows), "rows:", rows, flush=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
