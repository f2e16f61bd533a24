"""A layer built inside a submodule's __init__ that its forward never calls.

`Encoder.__init__` builds `self.skip` for a residual path that its forward no longer takes, so under
DDP with find_unused_parameters=False the reducer waits for `encoder.skip`'s gradients and the second
step fails. The place to fix is the line in `Encoder.__init__` that builds the layer, not the
model's `self.encoder = Encoder()`: a checker must locate the layer at the innermost line of the
user's code that built it. Fix: delete the layer (or freeze it).
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "issue 32 (a field trial's module, rebuilt)"


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x.mean(1) > 0).long())


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = torch.nn.Linear(8, 8)
        self.skip = torch.nn.Linear(8, 8)  # the residual path's projection, no longer used

    def forward(self, x):
        return torch.relu(self.mix(x))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.head = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.head(self.encoder(x)), y)

    def train_dataloader(self):
        return DataLoader(_data(64, 1), batch_size=8, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


EXPECTED = {"unused-parameters": "fail"}
EVIDENCE = ("'encoder.skip.weight' and 'encoder.skip.bias' built at this file's `Encoder.__init__` (the line of "
            "self.skip), not at the model's self.encoder line")
