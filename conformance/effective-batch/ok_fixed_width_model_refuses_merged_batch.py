"""CONFORMING: a model whose batch holds a fixed number of series (a layer sized n_series); the loss is a mean.

Rebuilt from neuralforecast 3.3.0 TSMixer (n_series=8; batch = all 8 series; mixing layers sized by n_series).
effective-batch's one-rank reference concatenates the ranks' batches along dim 0 (16 series), which the model
cannot take (there: `RuntimeError: The size of tensor a (16) must match the size of tensor b (8)`; here the time
axis doubles and the time layer refuses it). The merged batch is not
a batch of this model, so the comparison's premise does not hold: not judged, in one line, never an error with a
traceback (issue 11, kind 2c).
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "neuralforecast 3.3.0 models/tsmixer.py (n_series-sized mixing)"
EXPECTED = {"effective-batch": "nofail", "data-sharding": "pass", "sync-dist": "pass"}
EVIDENCE = "effective-batch not judged: the ranks' batches cannot be merged into one batch of this model"
N_SERIES, T = 4, 10


def _data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(16, T, N_SERIES, generator=g))  # each sample: one time block of all series


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(_data(), batch_size=None, shuffle=True)  # one sample = one batch [T, N_SERIES]


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.series_mix = torch.nn.Parameter(torch.eye(N_SERIES))
        self.time = torch.nn.Linear(T - 1, 1)

    def training_step(self, batch, batch_idx):
        (batch,) = batch  # [T, N_SERIES]
        x = batch * self.series_mix.diagonal()  # [T, N_SERIES] * [N_SERIES]: needs exactly N_SERIES columns
        x = x @ self.series_mix                 # dim 0 is time, not samples
        pred = self.time(x[:-1].T).squeeze(-1)
        return torch.nn.functional.mse_loss(pred, batch[-1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)
