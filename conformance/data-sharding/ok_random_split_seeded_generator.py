"""CONFORMING twin of random_split_unseeded_in_setup: the split draws from a generator seeded in the datamodule.

Same 48/16 split in setup(), but random_split gets generator=torch.Generator().manual_seed(42), so every rank
draws the same split whatever its global generator was seeded with (or not seeded at all), and Lightning's
DistributedSampler shares one training set out between the ranks.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset, random_split

SOURCE = "conforming (fix of random_split_unseeded_in_setup)"
EXPECTED = {"data-sharding": "pass", "sync-dist": "pass", "unused-parameters": "pass", "all-rank-save": "pass"}
EVIDENCE = "passes: the training subset is the same on every rank under per-rank seeds"


class DataModule(L.LightningDataModule):
    def setup(self, stage):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(64, 6, generator=g)
        full = TensorDataset(x, x[:, :2].sum(1, keepdim=True))
        self.train_set, self.val_set = random_split(full, [48, 16], generator=torch.Generator().manual_seed(42))

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=4, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(6, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True, batch_size=len(y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
