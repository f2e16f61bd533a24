"""CONFORMING: manual optimization accumulating over N=2 micro-batches, each loss divided by N.

The applied step is the gradient of the mean loss over the window, as automatic accumulation gives.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant"
ACCUM = 2
EXPECTED = {"effective-batch": "pass"}
EVIDENCE = "passes: manual_backward(loss / N)"


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(17)
        x = torch.randn(32, 6, generator=g)
        return DataLoader(TensorDataset(x, x @ torch.linspace(1.0, -1.0, 6).unsqueeze(1)), batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.lin = torch.nn.Linear(6, 1)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.lin(x), y)
        self.manual_backward(loss / ACCUM)
        if (batch_idx + 1) % ACCUM == 0:
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02)
