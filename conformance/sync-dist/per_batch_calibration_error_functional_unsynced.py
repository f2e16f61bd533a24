"""A calibration error computed per batch with a TorchMetrics function, imported from its own module, logged unsynced.

validation_step computes the expected calibration error of each batch with
`torchmetrics.functional.classification.calibration_error.binary_calibration_error` (imported from the module that
defines it, not from the package) and logs it on_epoch without sync_dist. Lightning averages the per-batch values on
each rank and publishes rank 0's mean: the calibration error is binned over the samples it is given, so a mean of
per-batch errors is not the error of the validation set, and it is rank 0's shard alone.
Fix: a torchmetrics BinaryCalibrationError object updated per batch and logged (it syncs and computes over the
epoch), or keep the probabilities and labels and compute once at epoch end over every rank's.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.functional.classification.calibration_error import binary_calibration_error

SOURCE = "variant (issue 32, section 3: a nonlinear metric from a functional call, logged without sync_dist)"
EXPECTED = {"sync-dist": "fail", "eval-duplication": "fail", "unused-parameters": "pass"}
EVIDENCE = ("'val_ece' logged per batch, binary_calibration_error nonlinear, not synced: rank 0's logged epoch "
            "value is not the calibration error over rank 0's samples; eval-duplication: val_ece published from "
            "rank 0's shard alone (32 of 64 validation samples)")


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] + 0.8 * torch.randn(n, generator=g) > 0).long())


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.binary_cross_entropy_with_logits(self.net(x).squeeze(1), y.float())

    def validation_step(self, batch, batch_idx):
        x, y = batch
        probs = torch.sigmoid(self.net(x).squeeze(1))
        self.log("val_ece", binary_calibration_error(probs, y, n_bins=5), on_epoch=True, batch_size=len(y))
        self.log("val_loss", torch.nn.functional.binary_cross_entropy(probs, y.float()), sync_dist=True,
                 batch_size=len(y))

    def train_dataloader(self):
        return DataLoader(_split(64, 3), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_split(64, 4), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
