"""A checkpoint saved on rank 0 only under DeepSpeed ZeRO stage 3: the save is a gather, and the run hangs.

The user guards Trainer.save_checkpoint with `if trainer.is_global_zero:` as they would for a plain file write.
Under ZeRO-3 every rank holds only a partition of the weights, and the engine's save gathers state across all
ranks: rank 0 waits in that gather for rank 1, which went on to the next step's collectives. On a cluster the
job hangs until the NCCL timeout; on CPU gloo ranks the same deadlock happens. Fix: call save_checkpoint on
every rank and keep the rank-zero guard for the print only.
"""
import os

import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"all-rank-save": "fail", "sync-dist": "nofail"}
EVIDENCE = "Trainer.save_checkpoint called on rank 0 only (if trainer.is_global_zero)"


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x[:, :3].sum(1, keepdim=True))


class RankZeroSnapshot(L.Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            path = os.path.join(trainer.default_root_dir, f"snapshot-epoch{trainer.current_epoch}.ckpt")
            trainer.save_checkpoint(path)
            print("CASE: rank 0 saved", path, flush=True)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def train_dataloader(self):
        return DataLoader(_split(64, 5), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def trainer_kwargs():
    return dict(max_epochs=2, strategy=DeepSpeedStrategy(stage=3), callbacks=[RankZeroSnapshot()])
