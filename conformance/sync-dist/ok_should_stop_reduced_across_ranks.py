"""Conforming: a stop decision taken from rank 0's bookkeeping is reduced across ranks before should_stop.

The same rank-0-only condition as should_stop_rank_local_train_batch_end.py (the mean of the last three training
losses on rank 0), but every rank passes its flag through trainer.strategy.reduce_boolean_decision(..., all=False)
after every batch: when rank 0 wants to stop, every rank stops after the same batch and the world finishes.
A checker must pass sync-dist here.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"sync-dist": "pass", "all-rank-save": "pass"}
EVIDENCE = "passes: should_stop changes at the same global step on every rank"


def _train():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 6, generator=g)
    y = (x[:, 0] > 0).float()
    return TensorDataset(x, y)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        self.recent = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.binary_cross_entropy_with_logits(self.net(x).squeeze(1), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        wants = False
        if self.trainer.is_global_zero:  # bookkeeping on the rank that prints
            self.recent.append(float(outputs["loss"]))
            wants = len(self.recent) >= 3 and sum(self.recent[-3:]) / 3 < 10.0
        if self.trainer.strategy.reduce_boolean_decision(wants, all=False):  # every rank calls it
            self.trainer.should_stop = True

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.binary_cross_entropy_with_logits(self.net(x).squeeze(1), y)
        self.log("val_loss", loss, sync_dist=True, batch_size=len(y))

    def train_dataloader(self):
        return DataLoader(_train(), batch_size=4, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_train(), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer_kwargs():
    return dict(max_epochs=2, num_sanity_val_steps=0, enable_checkpointing=False)
