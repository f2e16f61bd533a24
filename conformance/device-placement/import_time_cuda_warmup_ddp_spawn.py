"""The module warms the GPU up at import, and the Trainer config starts its ranks with ddp_spawn.

`_WARM = torch.zeros(1).cuda()` at the top of the file makes CUDA current in every process that imports
the module: the launching process and, since spawn re-imports the main module, every rank, each on GPU 0
(the current device until Lightning sets the rank's own). Under ddp_spawn that is not an error: each rank
later trains on its own GPU, but GPU 0 holds one CUDA context (and its memory) per rank of the node. A
forking strategy (ddp_fork, ddp_notebook) would refuse to start instead. device-placement reports it as an
advisory, with the line.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant (issue 34: torch.cuda at import time before ddp_spawn starts its processes)"
EXPECTED = {"device-placement": "advisory", "unused-parameters": "pass"}
EVIDENCE = ""

_WARM = torch.zeros(1).cuda()  # "so the first step does not pay for CUDA's start-up"


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x[:, 1:2])


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.reg = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.reg(x), y)

    def train_dataloader(self):
        return DataLoader(_data(32, 24), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"accelerator": "gpu", "devices": 2, "strategy": "ddp_spawn", "max_epochs": 1}
