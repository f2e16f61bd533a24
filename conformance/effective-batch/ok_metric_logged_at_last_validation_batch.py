"""CONFORMING: a callback logs the validation metric at the loader's last batch; ModelCheckpoint monitors it.

Rebuilt from replay-rec 0.22.0 (models/nn/sequential/callbacks/validation_callback.py: ValidationMetricsCallback
logs recall@k only when ``batch_idx + 1 == len(val loader)``) with ``ModelCheckpoint(monitor='recall@10')``.
The loss is a mean. With 10 validation samples in batches of 2, one rank has 5 validation batches and each of 2
ranks 3: a run of the plugin's that stops validation after 4 batches never reaches the last one, no recall@10
is logged and the user's ModelCheckpoint raises; that is the plugin's bound, never the user's fault (field26
item 6: the one-rank reference raised this and the reason blamed "the merged batch").
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "replay-rec 0.22.0 ValidationMetricsCallback + ModelCheckpoint(monitor='recall@10')"
EXPECTED = {"effective-batch": "pass"}
EVIDENCE = "passes: the one-rank reference validates the user's whole loader"


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x @ torch.linspace(0.5, -0.5, 6).unsqueeze(1))


class LastBatchMetrics(L.Callback):
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if batch_idx + 1 == len(trainer.val_dataloaders):
            pl_module.log("recall@10", torch.tensor(0.5, device=pl_module.device), sync_dist=True)


def trainer_kwargs():
    return {"callbacks": [LastBatchMetrics(), L.callbacks.ModelCheckpoint(monitor="recall@10", mode="max")]}


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(_data(32, 0), batch_size=4)

    def val_dataloader(self):
        return DataLoader(_data(10, 1), batch_size=2)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.lin(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_mse", torch.nn.functional.mse_loss(self.lin(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
