"""The module gathers every rank's host name in __init__, over a process group it made there.

For a per-node cache the user's __init__ builds `self.group = dist.new_group(ranks)` and gathers host names
with `dist.all_gather_object(names, socket.gethostname(), group=self.group)` whenever a process group is up
(their launcher initialises it before the model is built). The ranks' devices are not set yet: Lightning sets
each rank's GPU when fit starts. NCCL stages every object on torch.cuda.current_device(), GPU 0 on every rank
of a node: "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device", or the gather hangs without an
error (pytorch/pytorch#68973). Gloo stages objects in CPU memory, so CPU ranks are fine.
Fix: gather in setup() (the device is set by then), or torch.cuda.set_device(local_rank) first.
"""
import socket

import lightning.pytorch as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "https://github.com/pytorch/pytorch/issues/68973"
EXPECTED = {"device-placement": "fail", "unused-parameters": "pass"}
EVIDENCE = "`all_gather_object` in Model.__init__ runs before any rank's CUDA device is set"


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    return TensorDataset(x, x[:, :1] * 3)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.reg = torch.nn.Linear(3, 1)
        self.hosts = [socket.gethostname()]
        if dist.is_available() and dist.is_initialized():
            self.group = dist.new_group(list(range(dist.get_world_size())))
            self.hosts = [None] * dist.get_world_size()
            dist.all_gather_object(self.hosts, socket.gethostname(), group=self.group)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.reg(x), y)

    def train_dataloader(self):
        return DataLoader(_data(32, 14), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
