"""CONFORMING: the calibration error of its failing twin kept in a TorchMetrics object, logged as the object.

validation_step updates a BinaryCalibrationError object with each batch and logs the object itself: Lightning
calls its compute() at epoch end, over every rank's accumulated probabilities and labels (the object syncs its
state). The per-step loss is logged without sync_dist for the progress bar only (on_step, no epoch value).
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import BinaryCalibrationError

SOURCE = "variant (issue 32, section 3: the conforming form of a functional calibration error)"
EXPECTED = {"sync-dist": "pass", "eval-duplication": "pass", "unused-parameters": "pass"}
EVIDENCE = "passes, and names 'val_ece' (a TorchMetrics object) and 'train_loss' (per step only) as not compared"


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] + 0.8 * torch.randn(n, generator=g) > 0).long())


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.val_ece = BinaryCalibrationError(n_bins=5)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.binary_cross_entropy_with_logits(self.net(x).squeeze(1), y.float())
        self.log("train_loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        probs = torch.sigmoid(self.net(x).squeeze(1))
        self.val_ece.update(probs, y)
        self.log("val_ece", self.val_ece, on_epoch=True)
        self.log("val_loss", torch.nn.functional.binary_cross_entropy(probs, y.float()), sync_dist=True,
                 batch_size=len(y))

    def train_dataloader(self):
        return DataLoader(_split(64, 3), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_split(64, 4), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
