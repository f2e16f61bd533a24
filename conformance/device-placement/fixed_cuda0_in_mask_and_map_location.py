"""Two hard-coded GPU 0s: a mask built on torch.device("cuda", 0) and weights loaded with map_location="cuda:0".

The user ported a one-GPU notebook: setup() loads pretrained weights with
`torch.load(path, map_location="cuda:0")`, and training_step builds a dropout mask on `torch.device("cuda", 0)`.
Every rank loads the weights onto GPU 0 (a copy per rank on one GPU, apex#787's "only one gpu does work"),
and on rank 1, whose module is on cuda:1, the mask meets the activations: "Expected all tensors to be on the
same device, but found at least two devices, cuda:1 and cuda:0!". On CPU ranks the plugin runs both on the
rank's CPU and records the index each rank asked for.
Fix: map_location=self.device (or "cpu"), and torch.rand(..., device=h.device).
"""
import os

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant (issue 34: torch.device('cuda', 0) and map_location='cuda:0'; https://github.com/NVIDIA/apex/issues/787)"
EXPECTED = {"device-placement": "fail", "unused-parameters": "pass"}
EVIDENCE = "torch.load(map_location) and torch.rand ask for the hard-coded device 'cuda:0' on every rank"

WEIGHTS = "pretrained_head.pt"


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x[:, :2])


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(6, 8)
        self.head = torch.nn.Linear(8, 2)

    def prepare_data(self):
        if not os.path.exists(WEIGHTS):
            torch.save(torch.nn.Linear(8, 2).state_dict(), WEIGHTS)

    def setup(self, stage):
        self.head.load_state_dict(torch.load(WEIGHTS, map_location="cuda:0"))

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.relu(self.body(x))
        keep = (torch.rand(h.shape, device=torch.device("cuda", 0)) > 0.1).float()
        return torch.nn.functional.mse_loss(self.head(h * keep), y)

    def train_dataloader(self):
        return DataLoader(_data(32, 6), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
