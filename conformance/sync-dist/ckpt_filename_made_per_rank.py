"""ModelCheckpoint's filename carries a run id that each rank makes for itself.

The user names checkpoints after the run ("regression-<id>_{epoch}-{val_loss:.2f}") and makes the id where the
callbacks are built, which every rank does on its own; pytorch-tabular 1.2.0 does the same with a run counter
that each process bumps (found in a field trial). val_loss is synced, so every rank agrees on which epoch is best
and on its score, but each rank formats the path with its own id. Lightning writes the file from rank 0 only,
under rank 0's name; rank 1's best_model_path names a file that was never written, so anything that loads the
best checkpoint on every rank after fit (trainer.test(ckpt_path="best"), a resume) fails on rank 1.
Fix: make the run id once and give every rank the same filename (from the config, or broadcast rank 0's).
"""
import os
import uuid

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant (pytorch-tabular 1.2.0's per-process run counter in the checkpoint filename, field trial)"
EXPECTED = {"sync-dist": "fail", "all-rank-save": "pass"}
EVIDENCE = ("best_model_path differs per rank although the best score is the same on every rank: the filename is "
            "not the same on every rank; Fix: give ModelCheckpoint the same filename on every rank")


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, 0] - x[:, 2] > 0).long())


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True, batch_size=len(y))

    def on_fit_end(self):
        best = self.trainer.checkpoint_callback.best_model_path
        print("CASE: rank", self.global_rank, "best_model_path", os.path.basename(best),
              "exists", os.path.exists(best), flush=True)

    def train_dataloader(self):
        return DataLoader(_data(64, 81), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_data(32, 82), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.3)


def trainer_kwargs():
    run_id = uuid.uuid4().hex[:6]  # made on each rank: each names its checkpoints differently
    return dict(max_epochs=3, enable_checkpointing=True,
                callbacks=[ModelCheckpoint(monitor="val_loss", mode="min", save_top_k=1,
                                           filename=f"regression-{run_id}_{{epoch}}-{{val_loss:.2f}}")])
