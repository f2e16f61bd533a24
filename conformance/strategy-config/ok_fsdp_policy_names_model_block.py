"""CONFORMING: FSDP policies name the block class the model repeats; precision comes from the Trainer.

The model builds four Block layers in an idempotent configure_model; auto_wrap_policy and
activation_checkpointing_policy both name Block; reduced precision is requested with Trainer(precision=...),
so Lightning builds the MixedPrecision itself; the process-group timeout is set on the strategy.
"""
import datetime

import lightning.pytorch as L
import torch
import torch.nn as nn
from lightning.pytorch.strategies import FSDPStrategy
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"strategy-config": "pass", "configure-model": "pass", "sync-dist": "pass"}
EVIDENCE = "Block occurs 4 times; mixed precision from Trainer precision; timeout on FSDPStrategy"


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.ff = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        return x + self.ff(x)


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(23)
        x = torch.randn(32, 16, generator=g)
        return DataLoader(TensorDataset(x, x.sin()), batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.blocks = None

    def configure_model(self):
        if self.blocks is None:
            self.blocks = nn.Sequential(*[Block(16) for _ in range(4)])

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.blocks(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def trainer_kwargs():
    return {"strategy": FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block},
                                     timeout=datetime.timedelta(minutes=20)),
            "precision": "bf16-mixed"}
