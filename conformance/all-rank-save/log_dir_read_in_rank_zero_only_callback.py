"""A callback decorated with @rank_zero_only reads trainer.log_dir: the property broadcasts, so rank 0 waits alone.

A sample-plotting callback only needs to run on one process, so the user decorates its hook with
`@rank_zero_only` and builds the output folder from `trainer.log_dir`. The property is documented to be called
on every process: it broadcasts the directory from rank 0 (`strategy.broadcast`). Rank 0 makes that broadcast
alone while rank 1 goes on into the next epoch's collectives; the collectives no longer pair up and the world
hangs until gloo's timeout (the report: the job froze at the end of the first epoch).
Fix: read trainer.log_dir on every rank, before the rank-zero work; keep only the plotting under the guard.
"""
import os

import lightning.pytorch as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "issue 38 (a field trial's rebuilt report of trainer.log_dir in a rank-zero-only callback)"
EXPECTED = {"all-rank-save": "fail"}
EVIDENCE = ("log_dir's broadcast made on rank 0 alone at SamplePlots.on_train_epoch_end, met by another collective "
            "on rank 1; the fix reads `trainer.log_dir` (a property) on every rank")


class SamplePlots(L.Callback):
    @rank_zero_only
    def on_train_epoch_end(self, trainer, pl_module):
        out = os.path.join(trainer.log_dir, "samples")
        os.makedirs(out, exist_ok=True)


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x[:, :2].sum(1, keepdim=True))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(6, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def train_dataloader(self):
        return DataLoader(_rows(32, 1), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer_kwargs():
    return {"callbacks": [SamplePlots()], "max_epochs": 2}
