"""CONFORMING: a rank-0-only compute() of a metric that does not sync (sync_on_compute=False).

The callback prints rank 0's own running accuracy, and says so: the metric is built with
sync_on_compute=False, so compute() reads the local state and makes no collective. A compute that does not
sync is not collective-bearing, so the rank-zero guard around it is fine.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric

SOURCE = "conforming"
EXPECTED = {"all-rank-save": "pass"}
EVIDENCE = "MeanMetric(sync_on_compute=False).compute() on rank 0 makes no collective"


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


class Report(L.Callback):
    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            print("CASE: rank 0 local val_acc", float(pl_module.local_acc.compute()), flush=True)
        pl_module.local_acc.reset()


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 2)
        self.local_acc = MeanMetric(sync_on_compute=False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.local_acc.update((self.net(x).argmax(1) == y).float())

    def train_dataloader(self):
        return DataLoader(_split(32, 1), batch_size=8)

    def val_dataloader(self):
        return DataLoader(_split(16, 2), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"max_epochs": 2, "num_sanity_val_steps": 0, "callbacks": [Report()]}
