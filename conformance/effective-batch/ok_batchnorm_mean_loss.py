"""CONFORMING: a classifier with BatchNorm1d and a mean-reduced CrossEntropyLoss.

Rebuilt from ts3l 0.70 SCARF second phase (MLP backbone with use_batch_norm=True, BatchNorm1d head,
``nn.CrossEntropyLoss()``). The loss is a mean over equal counts, so its reduction does not depend on the world
size. In training mode BatchNorm normalises by each batch's own statistics, so 2 ranks x 8 rows and 1 rank x 16
rows compute different functions whatever the loss: comparing those gradients judged the batch statistics, not
the reduction (field26 item 5, a false FAILED "each rank normalises by its own count"). The comparison runs
with the batch-statistics layers in eval mode on both sides.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "ts3l 0.70 pl_modules/scarf_lightning.py + functional/scarf.py second_phase_loss (BatchNorm1d, mean CE)"
EXPECTED = {"effective-batch": "pass"}
EVIDENCE = "passes, with a note that BatchNorm1d ran in eval mode in both runs"
REDUCTION = "mean"


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(7)
        x = torch.randn(32, 6, generator=g) * torch.linspace(0.2, 3.0, 6)
        x[1::2] += 2.0  # the sampler's rank 1 gets the odd samples: its batch statistics differ from rank 0's
        return DataLoader(TensorDataset(x, torch.randint(0, 3, (32,), generator=g)), batch_size=8)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                       torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
        self.loss = torch.nn.CrossEntropyLoss(reduction=REDUCTION)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
