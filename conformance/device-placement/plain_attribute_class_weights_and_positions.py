"""Fixed tensors kept as plain attributes: class weights of the loss and a submodule's position table.

`self.class_weights = torch.tensor([...])` in the LightningModule and `self.positions = torch.arange(8)` in a
submodule are plain attributes, not buffers: Lightning's `.to(device)` moves parameters and buffers only, so on
GPU ranks both stay on the CPU. `F.cross_entropy(logits, y, weight=self.class_weights)` and
`x + self.scale * self.positions` then raise "Expected all tensors to be on the same device, but found at least
two devices, cuda:0 and cpu!". On CPU ranks everything is on the CPU and the run is clean.
Fix: self.register_buffer("class_weights", torch.tensor([...])) (and in the submodule).
"""
import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant (issue 34: module state kept as plain tensor attributes, which .to() does not move)"
EXPECTED = {"device-placement": "fail", "unused-parameters": "pass"}
EVIDENCE = ("self.class_weights (a plain attribute) meets the logits in `cross_entropy`; self.encoder.positions meets "
            "the activations")


class PositionalEncoder(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.proj = torch.nn.Linear(width, width)
        self.scale = torch.nn.Parameter(torch.tensor(0.1))
        self.positions = torch.arange(width, dtype=torch.float32)  # plain attribute: stays on the CPU

    def forward(self, x):
        return self.proj(x) + self.scale * self.positions


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0.5).long() + (x[:, 0] > -0.5).long())


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = PositionalEncoder(8)
        self.cls = torch.nn.Linear(8, 3)
        self.class_weights = torch.tensor([2.0, 1.0, 2.0])  # plain attribute, not a buffer

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.cls(torch.relu(self.encoder(x)))
        return F.cross_entropy(logits, y, weight=self.class_weights)

    def train_dataloader(self):
        return DataLoader(_data(32, 7), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
