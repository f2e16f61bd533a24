"""CONFORMING: input noise (torch.randn_like) and functional dropout inside the step; the loss is a mean.

The gradient depends on the draws, not on the world size: a checker must not call the draw-to-draw difference a
loss-reduction fault (not judged, naming the draw, is right).
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant"
EXPECTED = {"effective-batch": "nofail"}
EVIDENCE = "not judged: the gradient depends on random draws inside the step (torch.randn_like)"


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(32, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = x + 0.3 * torch.randn_like(x)
        h = torch.nn.functional.dropout(torch.relu(self.a(x)), p=0.2, training=self.training)
        return torch.nn.functional.mse_loss(self.b(h), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)
