"""A denoiser corrupts each batch with a torch.rand_like mask in training_step: the same mask on every rank, and
still conforming for data-sharding.

The mask comes from the global RNG, which starts from the same state on every rank and is consumed the same way, so
at every step both ranks draw the same mask. But the mask is multiplied into each rank's own (different) batch: it
is noise combined with the rank's data, like a dropout mask, not a sample of its own. Each rank still trains on its
own samples, so data-sharding passes (issue 19, section 3: a random tensor drawn identically on every rank is a
data-sharding failure only when it is itself the sample, as a GAN's latent input is: latent_noise_identical_across_
ranks). Was EXPECTED "fail" (issue 11) before that rule. A per-rank generator (seed + global_rank) would still give
the ranks more varied corruption.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "issue 11 (expectation revised by issue 19, section 3)"
EXPECTED = {"data-sharding": "pass"}
EVIDENCE = ("passes: torch.rand_like returns the same mask on rank 0 and rank 1, and the mask meets each rank's own "
            "batch (x * keep), so it is noise on the rank's data, not a sample")


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
