"""CONFORMING: a generator's latent noise from torch's global generator, reseeded with the rank in setup().

The fix the data-sharding page gives for latent_noise_identical_across_ranks, second form: setup() calls
torch.manual_seed(1234 + self.global_rank) once the model is built (DDP broadcasts the initial weights, so they
stay the same on every rank), and training_step draws z = torch.randn(...) from the global generator, which now
gives every rank its own stream. The plugin reseeds the ranks alike when training starts (seeding "both"), but
only where the module does not seed a generator itself: this module does, and its own seed must stand.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "issue 38 (the per-rank reseed the data-sharding fix names, under the plugin's seeding)"
LATENT = 3
EXPECTED = {"data-sharding": "pass", "sync-dist": "pass"}
EVIDENCE = "passes: the module reseeds each rank with its rank in setup(), so the latent batches differ"


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.generator = torch.nn.Sequential(torch.nn.Linear(LATENT, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    def setup(self, stage):
        torch.manual_seed(1234 + self.global_rank)

    def training_step(self, batch, batch_idx):
        real, _ = batch
        z = torch.randn(real.shape[0], LATENT, device=self.device)
        fake = self.generator(z)
        loss = (fake.mean(0) - real.mean(0)).pow(2).sum() + (fake.std(0) - real.std(0)).pow(2).sum()
        self.log("train_gap", loss, sync_dist=True, batch_size=len(real))
        return loss

    def train_dataloader(self):
        g = torch.Generator().manual_seed(9)
        pts = torch.randn(32, 2, generator=g)
        return DataLoader(TensorDataset(pts, torch.arange(32)), batch_size=4, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)
