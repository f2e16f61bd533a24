"""Every rank saves the trained weights to the same model.pt with torch.save at the end of training.

The most common shared write of all: `torch.save(self.state_dict(), "model.pt")` in on_train_end, no rank guard.
On one device it is fine; on 2 ranks both processes write the same path at the same moment (on a shared
filesystem the file can be torn or half-written when another job reads it). torch.save writes through C++, so a
checker that only watches Python's open() misses it. Fix: `if self.trainer.is_global_zero:` around the save (or
trainer.save_checkpoint on every rank, which writes once).
"""
import os

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"shared-writes": "fail", "data-sharding": "pass", "sync-dist": "pass"}
EVIDENCE = ("model.pt written with torch.save by rank 0 and rank 1 in on_train_end at "
            "every_rank_torch_saves_model_pt.py:43, outside checkpoint saving")


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(13)
        x = torch.randn(32, 4, generator=g)
        return DataLoader(TensorDataset(x, x.mean(dim=1, keepdim=True)), batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.lin(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def on_train_end(self):
        torch.save(self.state_dict(), os.path.join(self.trainer.default_root_dir, "model.pt"))
