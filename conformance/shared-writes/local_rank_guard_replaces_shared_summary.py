"""A `self.local_rank == 0` guard around a write-then-rename of a file in the shared run folder: both nodes rename it.

The timm training script created its checkpoint saver and wrote its summary under `if args.local_rank == 0:`; the
saver writes `tmp.pth.tar` in the shared output folder and then renames it into place with `os.replace`. On two nodes
each node's local rank 0 passes the guard: both write the same temp file on the shared filesystem, the first
`os.replace` moves it away, and the second raises `FileNotFoundError` (huggingface/pytorch-image-models#693). Here
each epoch's synced validation loss goes to `<default_root_dir>/summary.csv.tmp`, renamed to `summary.csv`.
Fix: guard a shared file with `self.trainer.is_global_zero` (the global rank zero), not the local rank.
"""
import os

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "https://github.com/huggingface/pytorch-image-models/issues/693"
EXPECTED = {"shared-writes": "fail", "node-local-files": "pass"}
EVIDENCE = ("<root>/summary.csv.tmp written and renamed by global rank 0 (node 0) and global rank 1 (node 1): "
            "both pass `if self.local_rank == 0:`; os.replace raised FileNotFoundError. Use trainer.is_global_zero")
# The fault shows only on a world of several nodes.
NODES = 2


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    return TensorDataset(x, x[:, :1] - x[:, 1:2])


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(_data(32, 61), batch_size=4, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_data(8, 62), batch_size=4)


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
        if self.local_rank == 0:  # timm: "if args.local_rank == 0: saver = CheckpointSaver(...)"
            final = os.path.join(self.trainer.default_root_dir, "summary.csv")
            tmp = final + ".tmp"
            with open(tmp, "w") as fh:
                fh.write(f"{self.current_epoch},{float(self.trainer.callback_metrics['val_loss']):.6f}\n")
            self.trainer.strategy.barrier()  # both writers are done before either renames (the race, made sure)
            os.replace(tmp, final)
        else:
            self.trainer.strategy.barrier()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
