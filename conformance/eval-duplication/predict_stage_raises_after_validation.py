"""FAULTY (validation) + predict_step that needs state set by the library's own predict API.

Rebuilt from pytorch-forecasting 1.8.0 / neuralforecast 3.3.0: predict_step reads attributes that only the
library's `model.predict(...)` sets (neuralforecast common/_base_model.py:1368 `self.predict_step_size`), so
Trainer.predict(model, datamodule) raises on every rank. Validation is an ordinary loop and is itself faulty:
the epoch metric is logged without sync_dist (pytorch-forecasting models/base/_base_model.py:960), so
callback_metrics on rank 0 hold rank 0's half of the validation set. An error in the predict stage must not
throw away the validation evidence (issue 11, kind 3).
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "pytorch-forecasting 1.8.0 models/base/_base_model.py:960; neuralforecast 3.3.0 _base_model.py:1368"
EXPECTED = {"eval-duplication": "fail", "sync-dist": "pass", "data-sharding": "pass"}
EVIDENCE = ("val_mae logged without sync_dist: rank 0 publishes its own shard; predict_step's AttributeError is a "
            "side note")


def _data(seed, n):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g))


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(_data(0, 32), batch_size=4, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_data(1, 32), batch_size=4)

    def predict_dataloader(self):
        return DataLoader(_data(2, 16), batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_mae", (self.net(x) - y).abs().mean(), on_epoch=True, batch_size=len(x))

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])[:, : self.predict_horizon]  # set only by the library's predict()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
