"""CONFORMING twin of metric_object_chosen_by_batch_content: every rank updates and logs both sources' metrics.

Same two sources and metrics, but validation_step updates each metric with the rows of its own source (where the
batch has any) and logs both keys on every rank, so at the epoch's end every rank computes the same metrics in
the same order and their syncs pair up (a metric a rank never updated contributes its empty state).
"""
import lightning.pytorch as L
import torch
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "conforming (fix of metric_object_chosen_by_batch_content)"
EXPECTED = {"sync-dist": "pass", "all-rank-save": "pass"}
EVIDENCE = "passes: every rank logs val_acc_clean and val_acc_noisy"


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    source = torch.arange(n) % 2  # rows alternate between the sources: rank r's shard is all source r
    return TensorDataset(x, (x[:, 0] > 0).long(), source)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(6, 3)
        self.metrics = torch.nn.ModuleDict({"clean": torchmetrics.Accuracy(task="multiclass", num_classes=3),
                                            "noisy": torchmetrics.Accuracy(task="binary")})

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y, source = batch
        preds = self.net(x).argmax(1)
        for code, name in enumerate(("clean", "noisy")):
            rows = source == code
            if rows.any():
                self.metrics[name].update(preds[rows] if name == "clean" else (preds[rows] > 0).long(), y[rows])
            self.log(f"val_acc_{name}", self.metrics[name], on_epoch=True)  # every key on every rank

    def train_dataloader(self):
        return DataLoader(_rows(32, 1), batch_size=4)

    def val_dataloader(self):
        return DataLoader(_rows(8, 2), batch_size=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
