"""CONFORMING: DeepSpeed ZeRO stage 3 with the layers built in an idempotent configure_model.

Lightning calls configure_model inside deepspeed.zero.Init under stage 3, so the layers are partitioned as they
are created; the early return keeps the trained layers when validate calls the hook again, and checkpoints are
saved on every rank. A checker must pass every contract here.
"""
import os

import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"all-rank-save": "pass", "sync-dist": "pass", "configure-model": "pass", "data-sharding": "pass",
            "shared-writes": "pass"}
EVIDENCE = "configure_model called twice (fit, then validate), later calls kept every parameter"

DS_CONFIG = {"zero_optimization": {"stage": 3, "overlap_comm": False}}


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x[:, :2] * 2.0)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = None

    def configure_model(self):
        if self.body is not None:
            return
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.body(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.body(x), y), sync_dist=True, batch_size=len(y))

    def on_train_end(self):
        path = os.path.join(self.trainer.default_root_dir, "final.ckpt")
        self.trainer.save_checkpoint(path)  # every rank: each holds a ZeRO-3 partition of the weights

    def train_dataloader(self):
        return DataLoader(_split(64, 3), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_split(32, 4), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def trainer_kwargs():
    return dict(max_epochs=2, strategy=DeepSpeedStrategy(config=DS_CONFIG))
