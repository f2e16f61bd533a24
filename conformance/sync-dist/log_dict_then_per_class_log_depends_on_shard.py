"""A synced log_dict of shared keys, then a synced self.log per class, only for the classes a rank has seen.

on_validation_epoch_end logs the overall accuracy with log_dict(sync_dist=True) (the same key on every
rank), then one self.log(f"val_acc_class{k}", sync_dist=True) per class present in this rank's shard.
Class 2 only occurs in rank 0's shard, so rank 0 makes one more synced call than rank 1 and the world's
all-reduces no longer pair up. The call to fix is the self.log line, not the log_dict line above it: a
checker must name the line of the call whose key the ranks disagree on. Fix: log every class on every
rank (a count-weighted or NaN-safe value), or a TorchMetrics per-class metric.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "issue 32 (R09 with a log_dict above the per-class log)"


def _split(n, seed, rare_class_every=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long()
    if rare_class_every:  # positions 0, 4, 8, ... are class 2: all of them land in rank 0's shard
        y[::rare_class_every] = 2
    return TensorDataset(x, y)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        self.pred, self.true = [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.pred.append(self.net(x).argmax(1))
        self.true.append(y)

    def on_validation_epoch_end(self):
        pred, true = torch.cat(self.pred), torch.cat(self.true)
        self.log_dict({"val_acc": (pred == true).float().mean()}, sync_dist=True)
        for k in true.unique():
            self.log(f"val_acc_class{int(k)}", (pred[true == k] == k).float().mean(), sync_dist=True)
        self.pred.clear()
        self.true.clear()

    def train_dataloader(self):
        return DataLoader(_split(64, 1, rare_class_every=4), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_split(32, 2, rare_class_every=4), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


EXPECTED = {"sync-dist": "fail", "all-rank-save": "pass", "unused-parameters": "pass"}
EVIDENCE = ("`self.log(sync_dist=True)` in on_validation_epoch_end logs different key sets per rank: rank 0 "
            "{val_acc, val_acc_class0, val_acc_class1, val_acc_class2}, rank 1 {val_acc, val_acc_class0, "
            "val_acc_class1}, at the self.log line")
