"""Conforming: a nonlinear metric kept as a TorchMetrics object and logged as the object.

The fix for the per-batch AUROC case, written from the rule text: training_step updates a BinaryAUROC
object with each batch and logs the object itself, so Lightning computes it once per epoch over every
sample of every rank (the object syncs its state), and the monitored validation loss is a plain mean
logged with sync_dist=True and batch_size. A checker must pass sync-dist here (no nonlinear-metric or
monitor finding).
"""
import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import BinaryAUROC

SOURCE = "seed"


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] + 0.5 * torch.randn(n, generator=g) > 0.9).long()
    return TensorDataset(x, y)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        self.train_auroc = BinaryAUROC()

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x).squeeze(1)
        self.train_auroc.update(logits.detach().sigmoid(), y)
        self.log("train_auroc", self.train_auroc, on_step=False, on_epoch=True)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, y.float())

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.binary_cross_entropy_with_logits(self.net(x).squeeze(1), y.float())
        self.log("val_loss", loss, sync_dist=True, batch_size=len(y))

    def train_dataloader(self):
        return DataLoader(_split(32, 1), batch_size=4, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_split(16, 2), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return dict(enable_checkpointing=True, callbacks=[ModelCheckpoint(monitor="val_loss", mode="min")])


EXPECTED = {"sync-dist": "pass", "all-rank-save": "pass", "unused-parameters": "pass"}
EVIDENCE = "passes: 'train_auroc' is the BinaryAUROC object itself; 'val_loss' is synced and equal on every rank"
