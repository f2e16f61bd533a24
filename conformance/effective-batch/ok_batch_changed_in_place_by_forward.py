"""CONFORMING: the forward writes its output back into the batch object (batch.x = layer(batch.x)).

Rebuilt from torch-geometric 2.8.1 GraphGym (graphgym/models/layer.py: each layer assigns ``batch.x = ...``; a PyG
``Batch.to(device)`` moves in place and returns the same object). The loss is a mean, so the gradient does not
depend on the world size. A batch that went through one forward has x of width 16, and a second forward on the
same object refuses it: every run of the plugin must step on its own copy of the samples (field26 item 3: the
one-rank reference stepped the same objects twice and blamed "the merged batch").
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset

SOURCE = "torch-geometric 2.8.1 graphgym/models/layer.py (batch.x = layer(batch.x))"
EXPECTED = {"effective-batch": "pass"}
EVIDENCE = "passes: both reference steps get their own copy of the merged batch"


class Graphs:
    """A batch object like PyG's Batch: fields set by attribute, moved in place."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def to(self, device):
        self.x, self.y = self.x.to(device), self.y.to(device)
        return self


class Samples(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(5, generator=g), torch.randn(1, generator=g)


def collate(samples):
    return Graphs(torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples]))


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(Samples(), batch_size=4, collate_fn=collate)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(5, 16)
        self.head = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        batch.x = torch.relu(self.encoder(batch.x))  # in place, as GraphGym's layers do
        return torch.nn.functional.mse_loss(self.head(batch.x), batch.y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
