"""A CPU-only Trainer config with a CPU tensor all-reduced: fine where it runs, an advisory for GPU ranks.

The Trainer config says accelerator="cpu": the module trains on CPU ranks with gloo, where an epoch count made
with torch.tensor(n) (no device) and all-reduced is correct. device-placement reports the same finding it
would fail under a GPU config as an advisory: the run is not broken, but moving this module to GPU ranks
would raise "No backend type associated with device type cpu".
"""
import lightning.pytorch as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant (issue 34: a CPU-only config gets the same finding as an advisory)"
EXPECTED = {"device-placement": "advisory", "unused-parameters": "pass"}
EVIDENCE = ""


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x[:, :1])


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.reg = torch.nn.Linear(4, 1)
        self._steps = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        self._steps += 1
        return torch.nn.functional.mse_loss(self.reg(x), y)

    def on_train_epoch_end(self):
        steps = torch.tensor(self._steps)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(steps)
        self._steps = 0

    def train_dataloader(self):
        return DataLoader(_data(32, 22), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"accelerator": "cpu", "max_epochs": 1}
