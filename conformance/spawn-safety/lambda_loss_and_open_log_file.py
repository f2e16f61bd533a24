"""The module keeps its loss as a lambda and the datamodule keeps an open log file; the config asks for ddp_spawn.

Everything works with strategy="ddp" (each rank builds its own objects). ddp_spawn instead pickles the
LightningModule, the datamodule and the Trainer to start each rank: pickling fails on the lambda (and then on the
open file) before any training, with a PicklingError that does not say which attribute. Fix: a module-level loss
function (or nn.MSELoss()), and open the file where it is written.
"""
import os
import tempfile

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"spawn-safety": "fail", "sync-dist": "pass", "data-sharding": "pass"}
EVIDENCE = ("Model.loss_fn does not pickle: it is a lambda (lambda_loss_and_open_log_file.py:36); "
            "DataModule.log does not pickle: an open file")


class DataModule(L.LightningDataModule):
    def __init__(self):
        super().__init__()
        self.log = open(os.path.join(tempfile.gettempdir(), "ltconform_case_dm.log"), "a")

    def train_dataloader(self):
        g = torch.Generator().manual_seed(29)
        x = torch.randn(32, 4, generator=g)
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.loss_fn = lambda pred, target: ((pred - target) ** 2).mean()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss_fn(self.lin(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"strategy": "ddp_spawn"}
