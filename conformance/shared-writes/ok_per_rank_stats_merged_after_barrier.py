"""CONFORMING: each rank writes its own stats file in the working directory, rank 0 merges them after a barrier.

A variant of ok_prediction_writer_per_rank_files during fit, with relative paths: at the end of every training epoch
a callback writes `stats_rank{global_rank}.json` (the rank's own loss sum and batch count) into the current working
directory, every rank waits at a barrier, and rank 0 alone reads all the files and writes the merged `stats.json`.
Processes of one node share their working directory, so rank 0 finds every rank's file; a checker that gives each rank
a folder of its own makes rank 0's read fail. No two ranks write the same path.
"""
import json
import os

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"shared-writes": "pass", "all-rank-save": "pass", "sync-dist": "pass", "unused-parameters": "pass",
            "data-sharding": "pass"}
EVIDENCE = "passes: stats_rank0.json (rank 0), stats_rank1.json (rank 1), stats.json by rank 0 only"


class EpochStats(L.Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        self.total, self.batches = 0.0, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.total += float(outputs["loss"])
        self.batches += 1

    def on_train_epoch_end(self, trainer, pl_module):
        with open(f"stats_rank{trainer.global_rank}.json", "w") as fh:  # one file per rank
            json.dump({"loss_sum": self.total, "batches": self.batches}, fh)
        trainer.strategy.barrier("stats")  # every rank's file is written
        if trainer.is_global_zero:
            parts = []
            for r in range(trainer.world_size):
                with open(f"stats_rank{r}.json") as fh:
                    parts.append(json.load(fh))
            merged = {"loss_sum": sum(p["loss_sum"] for p in parts), "batches": sum(p["batches"] for p in parts)}
            with open("stats.json", "w") as fh:
                json.dump(merged, fh)
            print("CASE: rank 0 merged", len(parts), "stats files in", os.getcwd(), flush=True)


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.reg = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.reg(x), y)

    def train_dataloader(self):
        return DataLoader(_data(32, 5), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"callbacks": [EpochStats()]}
