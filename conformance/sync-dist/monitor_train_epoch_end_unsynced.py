"""EarlyStopping checks a train metric at the train epoch's end, and that metric is not synced.

The module has no validation loop: it logs "train_loss" per epoch from training_step without sync_dist,
and EarlyStopping(monitor="train_loss", check_on_train_epoch_end=True) reads it in on_train_epoch_end.
Each rank's EarlyStopping then counts its patience on its own shard's loss (Lightning reduces only the
stop decision, "any rank"), so one rank's noise stops everyone. No validation ever runs, so a checker
that compares the monitor only after validation compares nothing here: it must compare the value where
the callback reads it. Fix: log the monitored metric with sync_dist=True.
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
        self.log("train_loss", loss, on_step=False, on_epoch=True, batch_size=len(y))  # not synced
        return loss

    def train_dataloader(self):
        return DataLoader(_split(64, 1), batch_size=8, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return dict(max_epochs=3, callbacks=[EarlyStopping(monitor="train_loss", mode="min", patience=2,
                                                       check_on_train_epoch_end=True)])


EXPECTED = {"sync-dist": "fail"}
EVIDENCE = ("monitored metric 'train_loss' (EarlyStopping monitor) logged without sync_dist; its value differs across "
            "ranks where it is `read by EarlyStopping in on_train_epoch_end`")
