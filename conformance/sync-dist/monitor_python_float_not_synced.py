"""The monitored metric is logged as a Python float (`.item()`) without sync_dist.

Written from the rule text: validation_step logs `loss.item()` as "val_loss", which EarlyStopping monitors.
Lightning warns that an epoch-level tensor should be logged with sync_dist=True, but gives no such warning
for a Python float, so the mistake goes unnoticed: every rank's EarlyStopping sees only its own validation
shard (here the shards differ on purpose), and the ranks disagree about whether the run improved.
Fix: log the tensor with sync_dist=True and batch_size (or a TorchMetrics object).
"""
import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import EarlyStopping
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"


def _split(n, seed, flip_odd=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] - x[:, 2] > 0).long()
    if flip_odd:  # rank 1's validation shard is labelled the other way round
        y[1::2] = 1 - y[1::2]
    return TensorDataset(x, y)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("val_loss", loss.item(), batch_size=len(y))  # a float: no sync, and no warning about it

    def train_dataloader(self):
        return DataLoader(_split(64, 1), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_split(32, 2, flip_odd=True), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.3)


def trainer_kwargs():
    return dict(max_epochs=3, callbacks=[EarlyStopping(monitor="val_loss", mode="min", patience=1)])


EXPECTED = {"sync-dist": "fail", "all-rank-save": "pass", "unused-parameters": "pass"}
EVIDENCE = ("monitored metric 'val_loss' (EarlyStopping monitor) logged without sync_dist in validation_step; "
            "its value differs across ranks at epoch end")
