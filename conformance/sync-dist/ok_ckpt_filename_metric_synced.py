"""Conforming: a checkpoint filename interpolates an error rate that every rank reduces.

ModelCheckpoint monitors "val_loss" and names its files "best-{epoch}-{val_err:.2f}"; both are logged from
validation_step with sync_dist=True and batch_size, so every rank formats the same name and records the same
best_model_path, the file rank 0 wrote. A checker must pass sync-dist here.
"""
import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"sync-dist": "pass", "all-rank-save": "pass", "unused-parameters": "pass"}
EVIDENCE = "passes: val_err is logged with sync_dist=True, so every rank builds the same checkpoint path"


def _split(n, seed, flip_odd=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] - x[:, 2] > 0).long()
    if flip_odd:  # rank 1's validation shard (odd positions) is labelled the other way round
        y[1::2] = 1 - y[1::2]
    return TensorDataset(x, y)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, y), sync_dist=True, batch_size=len(y))
        self.log("val_err", (logits.argmax(1) != y).float().mean(), sync_dist=True, batch_size=len(y))

    def train_dataloader(self):
        return DataLoader(_split(64, 71), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_split(32, 72, flip_odd=True), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.3)


def trainer_kwargs():
    return dict(max_epochs=2, enable_checkpointing=True,
                callbacks=[ModelCheckpoint(monitor="val_loss", mode="min", save_top_k=1,
                                           filename="best-{epoch}-{val_err:.2f}")])
