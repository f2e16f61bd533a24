"""Manual optimization over N=3 micro-batches; the loss is a sum of two terms and is never divided by N.

Each step applies 3x the gradient of the mean loss over the window.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant"
N = 3
EXPECTED = {"effective-batch": "fail"}
EVIDENCE = "3x the gradient of the mean loss over the same 3 micro-batches x 2 ranks"


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(23)
        x = torch.randn(48, 6, generator=g)
        return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = torch.nn.Linear(6, 2)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        ce = torch.nn.functional.cross_entropy(self.net(x), y)
        reg = self.net.weight.pow(2).mean()
        self.manual_backward(ce + 0.1 * reg)
        if (batch_idx + 1) % N == 0:
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
