"""Predictions copied to the CPU with non_blocking=True are turned into a list before the copy finished.

To overlap the copy with the next batch, validation_step writes `preds.to("cpu", non_blocking=True)` and reads
it at once with `.tolist()`. On a GPU a device-to-host copy with non_blocking=True lands in pinned memory
asynchronously: reading it before torch.cuda.synchronize() (or an event) reads whatever the buffer held,
silently (PyTorch's "good usage of non_blocking and pin_memory()" tutorial shows the wrong values). On CPU
ranks the copy is the tensor itself and the values are right.
Fix: torch.cuda.synchronize() before the read, or a blocking .cpu().
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant (issue 34: a non_blocking copy to the host read before it completes)"
EXPECTED = {"device-placement": "fail", "unused-parameters": "pass"}
EVIDENCE = "`Tensor.tolist` in validation_step reads a non_blocking=True copy before torch.cuda.synchronize()"


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 3] > 0).long())


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(6, 2)
        self.predictions = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        preds = self.net(x).argmax(1)
        host = preds.to("cpu", non_blocking=True)
        self.predictions.extend(host.tolist())

    def train_dataloader(self):
        return DataLoader(_data(32, 18), batch_size=4)

    def val_dataloader(self):
        return DataLoader(_data(16, 19), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
