"""ModelCheckpoint ends with the same best path on every rank, but with a different best score.

The monitored "val_loss" is logged without sync_dist, so each rank's ModelCheckpoint ranks its top k on
the loss of its own validation shard. The loss falls every epoch on both shards, so both ranks pick
the same epoch as best and build the same path: only best_model_score differs. A checker must say
what differs (the scores, and so the numbers each rank's top-k ranking is decided on), not that the
ranks keep a different best checkpoint. Fix: log the monitored metric with sync_dist=True.
"""
import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "issue 32 (a forecasting package's checkpoint config, rebuilt)"


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x[:, :2].sum(1, keepdim=True))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), batch_size=len(y))  # not synced

    def train_dataloader(self):
        return DataLoader(_split(64, 1), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_split(32, 2), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return dict(max_epochs=3, callbacks=[ModelCheckpoint(monitor="val_loss", mode="min", save_top_k=1,
                                                         filename="best-{epoch}")])


EXPECTED = {"sync-dist": "fail"}
EVIDENCE = ("a different 'best_model_score' on each rank, with the same 'best_model_path' on every rank: the ranks "
            "rank their top-k checkpoints on different numbers")
