"""Predictions turned into NumPy with .numpy() straight from the step, without .cpu().

validation_step collects `logits.argmax(1).numpy()` for a scikit-learn score at epoch end. On CPU ranks the
tensor is a CPU tensor and .numpy() works; on GPU ranks it is a CUDA tensor and the step raises
"TypeError: can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host
memory first." (a frequent first error on a GPU runner, e.g. Lightning-AI/pytorch-lightning#2442's
roc_auc_score on the device).
Fix: logits.argmax(1).detach().cpu().numpy().
"""
import lightning.pytorch as L
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant (issue 34: .numpy() of a tensor on the module's device; https://github.com/Lightning-AI/pytorch-lightning/issues/2442)"
EXPECTED = {"device-placement": "fail", "unused-parameters": "pass"}
EVIDENCE = ("`Tensor.numpy` in validation_step of a tensor on the module's device: 'TypeError: can't convert cuda:0 "
            "device type tensor to numpy'")


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 2] > 0).long())


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(6, 2)
        self._preds, self._targets = [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self._preds.append(self.net(x).argmax(1).numpy())
        self._targets.append(y.detach().cpu().numpy())

    def on_validation_epoch_end(self):
        acc = float((np.concatenate(self._preds) == np.concatenate(self._targets)).mean())
        self.log("val_acc", acc, sync_dist=True)
        self._preds, self._targets = [], []

    def train_dataloader(self):
        return DataLoader(_data(32, 10), batch_size=4)

    def val_dataloader(self):
        return DataLoader(_data(16, 11), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
