"""CONFORMING: the fixed latent-noise generator: each rank draws from its own generator seeded with the rank.

Same generator/MMD setup as latent_noise_identical_across_ranks, but setup() creates a torch.Generator seeded with
seed + global_rank and training_step passes it to torch.randn, so the ranks' latent batches differ at every step.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "issue 11"
LATENT = 3
EXPECTED = {"data-sharding": "pass"}
EVIDENCE = "torch.randn with a per-rank generator: different latent batches on each rank"


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.generator = torch.nn.Sequential(torch.nn.Linear(LATENT, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        self.noise = None

    def setup(self, stage):
        self.noise = torch.Generator().manual_seed(1234 + self.global_rank)

    def training_step(self, batch, batch_idx):
        real, _ = batch
        z = torch.randn(real.shape[0], LATENT, generator=self.noise).to(real.device)  # a CPU generator draws on the CPU
        fake = self.generator(z)
        return (fake.mean(0) - real.mean(0)).pow(2).sum() + (fake.std(0) - real.std(0)).pow(2).sum()

    def train_dataloader(self):
        g = torch.Generator().manual_seed(9)
        pts = torch.randn(32, 2, generator=g)
        return DataLoader(TensorDataset(pts, torch.arange(32)), batch_size=4, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)
