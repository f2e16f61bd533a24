"""An FSDP run saves its sharded "best so far" checkpoint from validation, but only on global rank 0.

The user moved from DDP, where a rank-zero guarded save merely wastes a barrier, to FSDPStrategy with
state_dict_type="sharded". A sharded save is a distributed checkpoint write: every rank must take part in
writing its own shard and the metadata exchange. With the guard, rank 0 enters that exchange alone while
rank 1 goes on to the next collective, so the world deadlocks (or collectives mismatch and crash).
Fix: call trainer.save_checkpoint on every rank; keep the guard for printing only.
"""
import os

import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
STRATEGY = "fsdp"
EXPECTED = {"all-rank-save": "fail", "sync-dist": "pass"}
EVIDENCE = ("Trainer.save_checkpoint called on rank 0 only from Model.on_validation_epoch_end under an "
            "`if self.trainer.is_global_zero` guard; under FSDP the save is itself a gather (rank 0 alone)")


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        self.best = float("inf")

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True, batch_size=len(y))

    def on_validation_epoch_end(self):
        loss = float(self.trainer.callback_metrics.get("val_loss", float("inf")))
        if self.trainer.is_global_zero and not self.trainer.sanity_checking and loss < self.best:
            self.best = loss
            self.trainer.save_checkpoint(os.path.join(self.trainer.default_root_dir, "best.ckpt"))

    def train_dataloader(self):
        return DataLoader(_split(64, 1), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_split(32, 2), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def trainer_kwargs():
    return dict(max_epochs=2, strategy=FSDPStrategy(state_dict_type="sharded"))
