"""Epoch statistics gathered with torch.distributed directly: a NumPy histogram and a list of CPU buffers.

At the end of each training epoch the user sums each rank's label histogram,
`counts = torch.from_numpy(np.bincount(...)); dist.all_reduce(counts)`, and gathers the ranks' last
predictions into buffers made with `torch.zeros(n)` (no device) while the predictions are on the rank's
device. Gloo takes both on CPU ranks. Under NCCL the first raises "No backend type associated with device
type cpu" and the gather into CPU buffers "Tensors must be CUDA and dense": NCCL needs CUDA tensors, in the
output list too.
Fix: counts.to(self.device); buffers made with torch.zeros_like(preds).
"""
import lightning.pytorch as L
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant (issue 34: torch.from_numpy and CPU all_gather buffers given to torch.distributed)"
EXPECTED = {"device-placement": "fail", "unused-parameters": "pass"}
EVIDENCE = ("torch.from_numpy made the histogram that reaches `all_reduce`; torch.zeros without a device made the "
            "`all_gather` list")


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(6, 3)
        self._labels, self._last = [], None

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self._labels.append(y.cpu().numpy())
        self._last = logits.detach().argmax(1).float()
        return torch.nn.functional.cross_entropy(logits, y)

    def on_train_epoch_end(self):
        counts = torch.from_numpy(np.bincount(np.concatenate(self._labels), minlength=3))
        self._labels = []
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
            gathered = [torch.zeros(len(self._last)) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, self._last)

    def train_dataloader(self):
        return DataLoader(_data(32, 3), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
