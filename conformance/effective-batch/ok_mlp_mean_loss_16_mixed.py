"""CONFORMING: a plain MLP with a mean-reduced loss under precision="16-mixed": world-size invariant.

Nothing couples the samples of a batch here: the loss is a mean over the batch, the layers are per-sample. The
2-rank gradient and the 1-rank gradient over the merged batch differ only by half-precision rounding (about 0.2 %
relative on this machine), which a field trial's run reported as "a loss or layer that couples the samples of a
batch". A checker must pass it and say the precision explains the gap.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "issue 38 (a field trial's wrong effective-batch sentence under 16-mixed)"
EXPECTED = {"effective-batch": "pass", "unused-parameters": "pass"}
EVIDENCE = "passes: within 16-mixed rounding"


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x[:, :2].sum(1, keepdim=True))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        return DataLoader(_rows(32, 1), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer_kwargs():
    return {"precision": "16-mixed"}
