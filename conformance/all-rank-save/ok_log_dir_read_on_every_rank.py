"""CONFORMING twin of log_dir_read_in_rank_zero_only_callback: every rank reads trainer.log_dir, rank 0 plots.

The callback reads `trainer.log_dir` on every rank (its broadcast pairs up), then creates the output folder
under an `if trainer.is_global_zero:` guard. all-rank-save passes and says that every rank made the same
collective-bearing call: the property's broadcast, at the same line.
"""
import os

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "conforming (fix of log_dir_read_in_rank_zero_only_callback)"
EXPECTED = {"all-rank-save": "pass", "sync-dist": "pass", "shared-writes": "pass"}
EVIDENCE = "passes: every rank made the same collective-bearing call, `trainer.log_dir` (its strategy.broadcast)"


class SamplePlots(L.Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        log_dir = trainer.log_dir  # on every rank: the property broadcasts
        if trainer.is_global_zero:
            os.makedirs(os.path.join(log_dir, "samples"), exist_ok=True)


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x[:, :2].sum(1, keepdim=True))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(6, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def train_dataloader(self):
        return DataLoader(_rows(32, 1), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer_kwargs():
    return {"callbacks": [SamplePlots()], "max_epochs": 2}
