"""The DataLoader gets its sampler as the fourth positional argument.

`DataLoader(ds, 8, False, RandomSampler(ds))` works on one device. On 2 ranks Lightning re-creates every
DataLoader with its DistributedSampler from the arguments the user passed; the positional sampler collides with
the injected `sampler=` keyword and fit raises a MisconfigurationException inside Lightning on every rank, with a
traceback that never shows the user's line. Fix: pass arguments by keyword (batch_size=..., sampler=...).
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

SOURCE = "issue"
EXPECTED = {"data-sharding": "fail"}
EVIDENCE = ("Lightning could not re-create the DataLoader with its DistributedSampler; sampler passed positionally (argument 4) "  # noqa: E501
            "at dataloader_sampler_positional.py:23 (DataModule.train_dataloader), on every rank")


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(32, 3, generator=g)
        ds = TensorDataset(x, x.sum(dim=1, keepdim=True))
        return DataLoader(ds, 8, False, RandomSampler(ds))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.lin(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
