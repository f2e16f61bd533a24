"""CONFORMING: a production config with LearningRateMonitor, a logger, ReduceLROnPlateau on val_loss, and a
validation interval in batches.

The user's Trainer config has a CSVLogger and a LearningRateMonitor (which refuses a Trainer without a logger), and
val_check_interval=50 (batches: their real epoch is long). The module's scheduler is ReduceLROnPlateau monitoring
val_loss, logged with sync_dist=True on every rank, so every epoch-end scheduler step needs validation to have run.
Everything here conforms. A checker that drops the logger makes LearningRateMonitor raise; one that caps the epoch
below the validation interval makes Lightning refuse it; one that resumes a sharded checkpoint with validation off
makes the scheduler miss val_loss. Each is the checker's own doing, never a finding.
"""
import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"all-rank-save": "pass", "sync-dist": "pass", "unused-parameters": "pass", "data-sharding": "pass",
            "shared-writes": "pass", "eval-duplication": "nofail", "effective-batch": "pass"}
EVIDENCE = "passes under every strategy; the header says LearningRateMonitor got a CSVLogger in the run folder"


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x[:, :3].sum(1, keepdim=True))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True, batch_size=len(y))

    def train_dataloader(self):
        return DataLoader(_rows(64, 1), batch_size=4, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_rows(16, 2), batch_size=4)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss", "interval": "epoch"}}


def trainer_kwargs():
    return {"logger": CSVLogger("logs"), "callbacks": [LearningRateMonitor(logging_interval="epoch")],
            "val_check_interval": 50, "max_epochs": 20}
