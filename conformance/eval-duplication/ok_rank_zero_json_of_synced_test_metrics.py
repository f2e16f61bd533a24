"""CONFORMING: rank 0 writes the test metrics Lightning reduced across ranks (a TorchMetrics accuracy) to a JSON file.

A variant of all-rank-save/ok_callback_metrics_read_before_guard in the test stage: the module logs a TorchMetrics
BinaryAccuracy object in test_step (Lightning computes it over every rank's samples at epoch end), and a callback
reads `trainer.logged_metrics` in on_test_end and writes them to test_metrics.json on rank 0 alone. The file holds
whole-set values, not rank 0's shard, so nothing needs gathering first. The 16 test samples split evenly over 2 ranks.
"""
import json
import os

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import BinaryAccuracy

SOURCE = "seed"
EXPECTED = {"eval-duplication": "pass", "shared-writes": "pass", "all-rank-save": "pass", "sync-dist": "pass"}
EVIDENCE = "passes: test_metrics.json written by rank 0 from trainer.logged_metrics (test_acc reduced over all ranks)"


class MetricsJSON(L.Callback):
    def on_test_end(self, trainer, pl_module):
        metrics = {k: float(v) for k, v in trainer.logged_metrics.items()}
        if trainer.is_global_zero:
            with open(os.path.join(trainer.default_root_dir, "test_metrics.json"), "w") as fh:
                json.dump(metrics, fh)


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.clf = torch.nn.Linear(4, 1)
        self.test_acc = BinaryAccuracy()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.binary_cross_entropy_with_logits(self.clf(x).squeeze(1), y.float())

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.test_acc(self.clf(x).squeeze(1).sigmoid(), y)
        self.log("test_acc", self.test_acc, on_epoch=True)

    def train_dataloader(self):
        return DataLoader(_rows(32, 11), batch_size=4)

    def test_dataloader(self):
        return DataLoader(_rows(16, 12), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer_kwargs():
    return {"callbacks": [MetricsJSON()]}
