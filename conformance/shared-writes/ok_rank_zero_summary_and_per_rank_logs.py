"""CONFORMING: rank 0 writes the shared summary; each rank writes only files named after its own rank.

The summary CSV is appended under `if self.trainer.is_global_zero:`, the final weights are saved by rank 0 only,
and each rank keeps a debug log whose name contains its global rank. Nothing is written twice.
"""
import os

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"shared-writes": "pass", "data-sharding": "pass", "sync-dist": "pass"}
EVIDENCE = "summary.csv and final.pt by rank 0 only; debug_rank0.log and debug_rank1.log by their own rank"


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(17)
        x = torch.randn(32, 4, generator=g)
        return DataLoader(TensorDataset(x, x[:, :1] + x[:, 1:2]), batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.lin(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def on_train_epoch_end(self):
        root = self.trainer.default_root_dir
        with open(os.path.join(root, f"debug_rank{self.global_rank}.log"), "a") as fh:
            fh.write(f"epoch {self.current_epoch} done\n")
        if self.trainer.is_global_zero:
            with open(os.path.join(root, "summary.csv"), "a") as fh:
                fh.write(f"{self.current_epoch},{float(self.trainer.callback_metrics['train_loss']):.5f}\n")

    def on_train_end(self):
        if self.trainer.is_global_zero:
            torch.save(self.state_dict(), os.path.join(self.trainer.default_root_dir, "final.pt"))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
