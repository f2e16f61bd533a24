"""Conforming twin of broadcast_run_name_before_set_device: the rank's GPU is set before the broadcast.

The script still starts the process group itself and broadcasts rank 0's run name before building the
Trainer, but first sets each rank's device from LOCAL_RANK, as torchrun's and NCCL's guides ask: NCCL then
stages the object on each rank's own GPU. The script is written for GPU nodes and calls
torch.cuda.set_device unconditionally; on CPU ranks the plugin runs that call as a record of the index.
"""
import os
import time

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "conforming (fix of https://github.com/pytorch/pytorch/issues/68973)"
EXPECTED = {"device-placement": "pass", "sync-dist": "pass", "unused-parameters": "pass"}
EVIDENCE = ""


def shared_run_name():
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    name = [time.strftime("run-%Y%m%d-%H%M%S")]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    return name[0]


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    return TensorDataset(x, x[:, :1] * 2 - x[:, 1:2])


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(_data(32, 95), batch_size=4, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_data(8, 96), batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.reg = torch.nn.Linear(5, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.reg(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.reg(x), y), sync_dist=True, batch_size=len(y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    run = shared_run_name()
    return {"enable_checkpointing": True, "max_epochs": 1,
            "callbacks": [ModelCheckpoint(filename=run + "-{epoch}", monitor="val_loss")]}
