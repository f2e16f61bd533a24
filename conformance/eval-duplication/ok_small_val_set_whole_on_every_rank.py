"""CONFORMING: a validation set smaller than the world is evaluated whole on every rank, on purpose.

Rebuilt from neuralforecast 3.3.0 (common/_base_model.py:1479, multivariate models): when there are fewer
validation windows than ranks, every rank evaluates all of them instead of sharding. Here the user turns off
Lightning's sampler (use_distributed_sampler=False), shards the training set with their own
DistributedSampler, and leaves validation unsharded; the validation loss is a mean over the same samples on
every rank, logged with sync_dist=True. Every sample is evaluated world-size times, but each weighs the same on
every rank, so the logged value is exactly the single-device value: repeated work, not a wrong number.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SOURCE = "neuralforecast 3.3.0 common/_base_model.py:1479"
EXPECTED = {"eval-duplication": "pass", "data-sharding": "pass", "sync-dist": "pass"}
EVIDENCE = "passes: every rank evaluates all 3 validation samples; val_loss equals the single-device value"


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    return TensorDataset(x, x @ torch.tensor([[0.5], [-0.2], [0.1], [0.3], [0.0]]))


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        ds = _data(32, 1)
        return DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, shuffle=True, seed=0))

    def val_dataloader(self):
        return DataLoader(_data(3, 2), batch_size=3)  # smaller than the world: every rank takes it whole


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(5, 1)

    def on_train_epoch_start(self):
        self.trainer.train_dataloader.sampler.set_epoch(self.current_epoch)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True, batch_size=len(y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"use_distributed_sampler": False, "max_epochs": 2}
