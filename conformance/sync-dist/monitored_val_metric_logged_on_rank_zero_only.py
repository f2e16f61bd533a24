"""The metric ModelCheckpoint monitors is logged under a rank-zero guard, so the other ranks never log it.

validation_step logs "val_acc" only when global_rank == 0. Rank 0's ModelCheckpoint finds it; on rank 1
the key is missing from the callback metrics after validation, so rank 1's ModelCheckpoint raises
MisconfigurationException ("could not find the monitored key") while rank 0 goes on into the next
epoch's collectives. The first cause is the one-sided log of a monitored metric, not the crash it leads to.
Fix: log the monitored metric on every rank with sync_dist=True (rank_zero_only=True is not enough either:
each rank's callback needs the same reduced value).
"""
import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "walkthrough"


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(6, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.global_rank == 0:  # the guard that hides the monitored key from rank 1
            self.log("val_acc", -loss, batch_size=len(y))

    def train_dataloader(self):
        return DataLoader(_split(64, 1), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_split(32, 2), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"max_epochs": 2, "callbacks": [ModelCheckpoint(monitor="val_acc", mode="max")]}


EXPECTED = {"sync-dist": "fail", "all-rank-save": "pass", "unused-parameters": "pass"}
EVIDENCE = ("monitored key 'val_acc' logged on rank 0 only (rank 1: never) at validation_step under "
            "`if self.global_rank == 0:`; rank 1's ModelCheckpoint raised MisconfigurationException")
