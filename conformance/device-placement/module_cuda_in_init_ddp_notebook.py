"""The module moves itself to the GPU in __init__, and the Trainer config starts its ranks by forking.

`self.backbone.cuda()` in __init__ makes CUDA current in the notebook's process before the Trainer starts.
With strategy="ddp_notebook" (fork) Lightning then refuses to launch: "Lightning can't create new processes if
CUDA is already initialized. Did you manually call `torch.cuda.*` functions, have moved the model to the
device, or allocated memory on the GPU any other way?"; a forked process that used it would raise "Cannot
re-initialize CUDA in forked subprocess". The plugin starts the ranks itself (ddp_notebook runs as ddp here)
and runs .cuda() on the CPU, so it records where CUDA was made current and judges it against the config.
Fix: let Lightning move the module (no .cuda() in __init__).
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant (issue 34: torch.cuda.* in __init__ before a forking strategy starts its processes)"
EXPECTED = {"device-placement": "fail", "unused-parameters": "pass"}
EVIDENCE = "`Tensor.cuda` in Model.__init__ makes CUDA current before the Trainer forks its processes"


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x[:, :1])


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Linear(4, 1)
        self.backbone.cuda()  # "so the notebook's first cell already runs on the GPU"

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.backbone(x), y)

    def train_dataloader(self):
        return DataLoader(_data(32, 13), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"accelerator": "gpu", "devices": 2, "strategy": "ddp_notebook", "max_epochs": 1}
