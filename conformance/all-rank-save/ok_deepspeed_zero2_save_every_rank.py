"""CONFORMING: DeepSpeed ZeRO stage 2, a callback that saves a checkpoint on every rank and prints on rank 0.

Under DeepSpeed, Trainer.save_checkpoint writes a checkpoint directory through the engine: every rank writes its
own optimizer partition, and the save ends in a barrier. The callback calls it on every rank and keeps its
rank-zero guard for the log line only; metrics are logged with sync_dist on every rank. The optimizer state is
offloaded to CPU, which the CPU tier cannot run (DeepSpeedCPUAdam is a compiled op): it runs without offload,
the same collectives, and says so in the item's note. A checker must pass every contract here, under the real
DeepSpeed on CPU gloo ranks as well as under DDP and FSDP.
"""
import os

import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"all-rank-save": "pass", "sync-dist": "pass", "configure-model": "pass", "data-sharding": "pass",
            "shared-writes": "pass"}
EVIDENCE = "every rank made the same collective-bearing calls (Trainer.save_checkpoint x2)"


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x[:, :3].sum(1, keepdim=True))


class EverySnapshot(L.Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        path = os.path.join(trainer.default_root_dir, f"snapshot-epoch{trainer.current_epoch}.ckpt")
        trainer.save_checkpoint(path)  # every rank: each writes its ZeRO partition
        if trainer.is_global_zero:
            print("CASE: saved", path, sorted(os.listdir(path)) if os.path.isdir(path) else "(one file)", flush=True)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True, batch_size=len(y))

    def train_dataloader(self):
        return DataLoader(_split(64, 1), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_split(32, 2), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def trainer_kwargs():
    return dict(max_epochs=2, strategy=DeepSpeedStrategy(stage=2, offload_optimizer=True), callbacks=[EverySnapshot()])
