"""A callback prints the epoch's accuracy on rank 0 only, calling the synced metric's compute() there.

The module keeps a torchmetrics MeanMetric of per-sample correctness (synced on compute, the default). A
reporting callback reads `pl_module.val_acc.compute()` under `if trainer.is_global_zero:`. compute() all-gathers
the metric state from every rank, so rank 0 enters a collective that rank 1 skips: the world hangs or the
collectives mismatch. Fix: call compute() on every rank and print on rank 0 only.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric

SOURCE = "seed"
EXPECTED = {"all-rank-save": "fail"}
EVIDENCE = ("MeanMetric.compute called on rank 0 only from Report.on_validation_epoch_end under an "
            "`if trainer.is_global_zero:` guard")


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


class Report(L.Callback):
    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            print("CASE: epoch", trainer.current_epoch, "val_acc", float(pl_module.val_acc.compute()), flush=True)
        pl_module.val_acc.reset()


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 2)
        self.val_acc = MeanMetric()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_acc.update((self.net(x).argmax(1) == y).float())

    def train_dataloader(self):
        return DataLoader(_split(32, 1), batch_size=8)

    def val_dataloader(self):
        return DataLoader(_split(16, 2), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"max_epochs": 2, "num_sanity_val_steps": 0, "callbacks": [Report()]}
