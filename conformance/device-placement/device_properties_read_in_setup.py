"""setup() sizes a buffer from the GPU's total memory: nothing a CPU-only torch can give.

`torch.cuda.get_device_properties(self.device).total_memory` decides how many samples a cache keeps. On CPU
ranks there is no CUDA device to ask: the plugin runs code that names CUDA on the rank's CPU, but cannot make
up a GPU's properties, so the run stops there and what follows is not judged, with the line that asked. The
GPU tier runs it.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant (issue 34: a CUDA call the plugin cannot run on a CPU: not judged, with the line)"
EXPECTED = {"device-placement": "nofail", "unused-parameters": "nofail", "all-rank-save": "nofail"}
EVIDENCE = ""


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x[:, :1])


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.reg = torch.nn.Linear(4, 1)

    def setup(self, stage):
        total = torch.cuda.get_device_properties(0).total_memory
        self.cache_size = int(total // (4 * 1024 ** 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.reg(x), y)

    def train_dataloader(self):
        return DataLoader(_data(32, 17), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
