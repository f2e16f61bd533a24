"""A sum-reduced loss on a model that also registers a block it never calls (find_unused_parameters=False).

The unused block leaves a DDP bucket unreduced unless the run keeps DDP going with find_unused_parameters=True;
the effective-batch comparison must still see the sum reduction: half the gradient on 2 ranks x batch 4 as on
1 rank x batch 8 of the same samples.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant"
EXPECTED = {"effective-batch": "fail"}
EVIDENCE = "ratio 0.5: reduction='sum' under DDP averaging, with an unused registered block"


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(7)
        x = torch.randn(32, 6, generator=g)
        return DataLoader(TensorDataset(x, x @ torch.linspace(1, -1, 6).unsqueeze(1)), batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 1)
        self.unused = torch.nn.Linear(6, 6)  # registered, never called

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.lin(x), y, reduction="sum")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
