"""CONFORMING: a VAE draws its reparameterisation noise with torch.randn_like: the same on every rank, combined with
each rank's own encoding.

z = mu + eps * std with eps = torch.randn_like(std) from the global RNG, seeded alike on every rank, so eps is the
same tensor on rank 0 and rank 1 at every step. But mu and std come from each rank's own (sharded) batch: the noise
perturbs the rank's data, it is not a sample of its own. A GAN's latent input is (latent_noise_identical_across_
ranks); this is not, and data-sharding must pass it.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant (issue 19, section 3: noise combined with the rank's data)"
EXPECTED = {"data-sharding": "pass"}
EVIDENCE = "passes: torch.randn_like is identical across ranks but multiplies each rank's own std (eps * std)"


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(6, 4)
        self.decoder = torch.nn.Linear(2, 6)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        mu, logvar = self.encoder(x).chunk(2, dim=1)
        std = (0.5 * logvar).exp()
        eps = torch.randn_like(std)
        z = mu + eps * std
        recon = torch.nn.functional.mse_loss(self.decoder(z), x)
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(1).mean()
        return recon + 0.1 * kl

    def train_dataloader(self):
        g = torch.Generator().manual_seed(9)
        return DataLoader(TensorDataset(torch.randn(32, 6, generator=g)), batch_size=4, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
