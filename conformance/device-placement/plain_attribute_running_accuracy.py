"""A running accuracy kept in plain tensor attributes, accumulated in place and logged with sync_dist=True.

`self.correct = torch.tensor(0)` and `self.total = torch.tensor(0)` are made in __init__ as plain attributes
(not a TorchMetrics metric, not buffers), so on GPU ranks they stay on the CPU. validation_step adds to them in
place, `self.correct += (preds == y).sum()`: a CPU result from a CUDA operand, "Expected all tensors to be on
the same device". Had that passed, on_validation_epoch_end logs `self.correct / self.total` with
sync_dist=True, which Lightning all-reduces on the CPU: "No backend type associated with device type cpu".
Fix: a torchmetrics.Accuracy (its state moves and syncs with the module), or register_buffer.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant (issue 34: a metric state kept as a plain attribute, updated in place and reduced)"
EXPECTED = {"device-placement": "fail", "unused-parameters": "pass"}
EVIDENCE = "self.correct (a plain attribute) is updated in place with the predictions in validation_step"


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long())


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(6, 2)
        self.correct = torch.tensor(0)
        self.total = torch.tensor(0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        preds = self.net(x).argmax(1)
        self.correct += (preds == y).sum()
        self.total += len(y)

    def on_validation_epoch_end(self):
        self.log("val_acc", self.correct / self.total, sync_dist=True)
        self.correct, self.total = torch.tensor(0), torch.tensor(0)

    def train_dataloader(self):
        return DataLoader(_data(32, 8), batch_size=4)

    def val_dataloader(self):
        return DataLoader(_data(16, 9), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
