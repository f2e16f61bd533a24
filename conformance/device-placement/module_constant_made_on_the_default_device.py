"""A module-level constant tensor, made at import on the default device, is added to the activations.

`POSITIONS = torch.linspace(0.0, 1.0, 8)` at the top of the file is made on the CPU when the module is
imported, on GPU ranks too, and forward adds it to activations on the rank's GPU: "Expected all tensors to be
on the same device, but found at least two devices, cuda:0 and cpu!". Like a plain attribute, nothing moves
it with the module; on CPU ranks it is on the same device as everything else.
Fix: register it as a buffer (self.register_buffer("positions", POSITIONS.clone())) or move it in forward.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant (issue 34: a tensor made at import time, off the module's device)"
EXPECTED = {"device-placement": "fail", "unused-parameters": "pass"}
EVIDENCE = "POSITIONS made by torch.linspace without a device at import meets the activations in forward"

POSITIONS = torch.linspace(0.0, 1.0, 8)


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.out(torch.relu(self.inp(x) + POSITIONS))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def train_dataloader(self):
        return DataLoader(_data(32, 23), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
