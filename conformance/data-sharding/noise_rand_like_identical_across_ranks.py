"""A denoiser corrupts each batch with torch.rand_like noise in training_step: identical on every rank.

The noise mask comes from the global RNG, which starts from the same state on every rank and is consumed the same
way, so at every step both ranks corrupt their (different) batches with the same mask: the world sees one rank's
noise world_size times. Fix: a per-rank torch.Generator seeded with seed + global_rank in setup().
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "issue 11"
EXPECTED = {"data-sharding": "fail"}
EVIDENCE = "torch.rand_like at the training_step line returns the same values on rank 0 and rank 1 at every step"


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 6))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        keep = (torch.rand_like(x) > 0.3).float()
        return torch.nn.functional.mse_loss(self.net(x * keep), x)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(8)
        return DataLoader(TensorDataset(torch.randn(32, 6, generator=g)), batch_size=4, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
