"""CONFORMING: training_step subsamples rows of its own (rank-sharded) batch with torch.randperm from the
global RNG, seeded alike on every rank (neuralforecast 3.3.0 BaseModel.on_fit_start reseeds with random_seed;
training_step draws `torch.randperm(n_windows)[:windows_batch_size]`, common/_base_model.py:2371).

The drawn *indices* are the same on every rank, but they index different data (DistributedSampler shards the
dataset), so every rank trains on different samples; nothing is repeated across ranks. data-sharding's
"random inputs identical on every rank" rule is about random values used as inputs (latent noise), not about
indices into rank-local data.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "neuralforecast 3.3.0 common/_base_model.py:1019 (reseed) and :2371 (randperm window draw)"
EXPECTED = {"data-sharding": "pass", "effective-batch": "nofail"}
EVIDENCE = "passes: randperm indices are identical per rank but select rows of different, rank-sharded batches"


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(_data(), batch_size=8, shuffle=True)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(6, 1)

    def on_fit_start(self):
        torch.manual_seed(1)  # the library reseeds every rank with the same random_seed

    def training_step(self, batch, batch_idx):
        x, y = batch
        keep = torch.randperm(len(x))[:4]  # subsample 4 of this rank's 8 rows
        return torch.nn.functional.mse_loss(self.net(x[keep]), y[keep])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
