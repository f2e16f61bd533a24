"""CONFORMING: under FSDP with sharded checkpoints, a callback saves on every rank and keeps its rank-zero
guard for the log line only.

Trainer.save_checkpoint under a sharded strategy is a collective: every rank writes its own shard into the
checkpoint directory (per-rank .distcp files plus .metadata). The callback calls it on every rank and only
prints on rank 0. The directory resumes with Trainer(ckpt_path=dir) and the same strategy. A checker must pass
all-rank-save here under the CPU sharded tier, including its own save-and-resume round trip.
"""
import os

import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
STRATEGY = "fsdp"
EXPECTED = {"all-rank-save": "pass", "sync-dist": "pass", "configure-model": "pass"}
EVIDENCE = ("every rank made the same collective-bearing calls (Trainer.save_checkpoint x2); every rank saved "
            "a sharded checkpoint directory and a fit resumed from it with the matching strategy")


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x[:, :3].sum(1, keepdim=True))


class ShardedSnapshot(L.Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        path = os.path.join(trainer.default_root_dir, f"snapshot-epoch{trainer.current_epoch}.ckpt")
        trainer.save_checkpoint(path)  # every rank: each writes its shard
        if trainer.is_global_zero:
            print("CASE: saved", path, sorted(os.listdir(path)) if os.path.isdir(path) else "(one file)", flush=True)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

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
    return dict(max_epochs=2, strategy=FSDPStrategy(state_dict_type="sharded"), callbacks=[ShardedSnapshot()])
