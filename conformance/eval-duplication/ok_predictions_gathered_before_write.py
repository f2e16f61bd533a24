"""CONFORMING: predictions are gathered from every rank, with their ids, before rank 0 writes the file.

Like predict_rank_shard_as_complete, but on_predict_epoch_end first calls
torch.distributed.all_gather_object on every rank, so rank 0 writes all 7 rows (ids 0..6) under its
is_global_zero guard. Lightning's predict sampler does not pad, so every sample is predicted exactly once.
A checker must pass eval-duplication here.
"""
import csv
import os

import lightning.pytorch as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

SOURCE = "conforming"
PLAIN_DRIVER = "predict"


class Rows(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 5, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], i


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(Rows(16, seed=11), batch_size=4)

    def predict_dataloader(self):
        return DataLoader(Rows(7, seed=12), batch_size=2)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.reg = torch.nn.Linear(5, 1)
        self.rows = []

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return self.reg(x).pow(2).mean()

    def predict_step(self, batch, batch_idx):
        x, idx = batch
        return {"id": idx, "pred": self.reg(x).squeeze(1)}

    def on_predict_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.rows += zip(outputs["id"].tolist(), outputs["pred"].tolist())

    def on_predict_epoch_end(self):
        every = [None] * self.trainer.world_size
        if dist.is_available() and dist.is_initialized() and self.trainer.world_size > 1:
            dist.all_gather_object(every, self.rows)  # on every rank
        else:
            every = [self.rows]
        if self.trainer.is_global_zero:
            rows = sorted(r for part in every for r in part)
            with open(os.path.join(self.trainer.default_root_dir, "predictions.csv"), "w", newline="") as fh:
                csv.writer(fh).writerows([("id", "pred"), *rows])
            print("CASE: predictions.csv has ids", [i for i, _ in rows], flush=True)
        self.rows = []

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


EXPECTED = {"eval-duplication": "pass", "all-rank-save": "pass", "unused-parameters": "pass"}
EVIDENCE = ("passes: every prediction index 0..6 predicted exactly once across ranks (rank 0: 4, rank 1: 3), "
            "and the rank-0 predictions.csv is written after an all_gather_object of every rank's rows")
