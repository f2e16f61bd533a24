"""A classifier with BatchNorm1d and a sum-reduced CrossEntropyLoss: the step shrinks with the world size.

The same model as ok_batchnorm_mean_loss.py with reduction="sum": DDP averages the ranks' gradients, so the
same 16 samples give half the gradient on 2 ranks. BatchNorm's batch statistics must not hide the fault: the
comparison runs with them in eval mode on both sides, and the factor is the world size.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant of ok_batchnorm_mean_loss.py"
EXPECTED = {"effective-batch": "fail"}
EVIDENCE = "the gradient shrinks by the world size (2): a sum-reduced loss (ratio 0.5)"
REDUCTION = "sum"


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
