"""A `self.local_rank == 0` guard protects a write to the shared run directory: one writer per NODE, not per job.

The user appends each epoch's synced validation loss to `<default_root_dir>/val_history.csv` and guards it with
`if self.local_rank == 0:` (the pattern from torch.distributed.launch scripts, where `args.local_rank` decides who
logs and saves). On one node exactly one process passes the guard. On two nodes each node's first process passes
it, so both append to the same file on the shared filesystem: every epoch's row appears twice, and writers on
different hosts can interleave. The reports: a training script guarded checkpoint saving with local_rank, "so it
repeats for each node ... more than one node trying to write the checkpoint files in the same time"
(NVIDIA/DeepLearningExamples#1092); the same fix in huggingface/transformers#3356 ("one process per node having
local_rank as 0, hence multiple processes try writing").
Fix: guard shared writes with `self.trainer.is_global_zero` (or @rank_zero_only).
"""
import os

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "https://github.com/NVIDIA/DeepLearningExamples/issues/1092"
EXPECTED = {"shared-writes": "fail", "sync-dist": "pass", "unused-parameters": "pass"}
EVIDENCE = ("<root>/val_history.csv appended by global rank 0 (node 0) and global rank 1 (node 1): both pass "
            "`self.local_rank == 0` in on_validation_epoch_end; it ends with 4 rows for 2 epochs. "
            "Use trainer.is_global_zero")
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
        if self.local_rank == 0:  # "only the main process writes"
            path = os.path.join(self.trainer.default_root_dir, "val_history.csv")
            with open(path, "a") as fh:
                fh.write(f"{self.current_epoch},{float(self.trainer.callback_metrics['val_loss']):.6f}\n")
            print("CASE: rank", self.global_rank, "node", self.trainer.node_rank, "local_rank", self.local_rank,
                  "appended epoch", self.current_epoch, flush=True)

    def on_fit_end(self):
        self.trainer.strategy.barrier()
        if self.trainer.is_global_zero:
            with open(os.path.join(self.trainer.default_root_dir, "val_history.csv")) as fh:
                rows = fh.read().splitlines()
            print("CASE: val_history.csv has", len(rows), "rows:", rows, flush=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
