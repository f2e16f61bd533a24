"""Noise drawn inside the step from a generator seeded per batch (deterministic), with a sum-reduced loss.

The draws are a function of the batch index, so the step is still a function of weights and samples and the
comparison is fair: the sum reduction must fail (ratio 1/world size).
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant"
EXPECTED = {"effective-batch": "fail"}
EVIDENCE = "ratio 0.5: reduction='sum'; the seeded noise does not make the step random"


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(11)
        x = torch.randn(32, 5, generator=g)
        return DataLoader(TensorDataset(x, x @ torch.linspace(-1, 1, 5).unsqueeze(1)), batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(5, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        g = torch.Generator().manual_seed(1000 + batch_idx)
        x = x + 0.01 * torch.randn(x.shape, generator=g)
        return torch.nn.functional.mse_loss(self.lin(x), y, reduction="sum")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
