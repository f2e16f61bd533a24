"""Conforming: EarlyStopping checks a synced train metric at the train epoch's end.

The module has no validation loop: it logs "train_loss" per epoch from training_step with sync_dist=True,
and EarlyStopping(monitor="train_loss", check_on_train_epoch_end=True) reads it in on_train_epoch_end,
the same value on every rank. A checker must pass, saying which reads it compared (no validation ever
runs, so a pass that compared the monitor after validation would have compared nothing).
"""
import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import EarlyStopping
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "issue 32 (a forecasting package's early-stopping config, rebuilt)"


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, :2].sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, batch_size=len(y), sync_dist=True)
        return loss

    def train_dataloader(self):
        return DataLoader(_split(64, 1), batch_size=8, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return dict(max_epochs=3, callbacks=[EarlyStopping(monitor="train_loss", mode="min", patience=2,
                                                       check_on_train_epoch_end=True)])


EXPECTED = {"sync-dist": "pass", "all-rank-save": "pass", "unused-parameters": "pass"}
EVIDENCE = "passes: 'train_loss' equal on every rank where EarlyStopping reads it, in on_train_epoch_end"
