"""The training loss turns nan on rank 1 from the third step: a 0/0 in the loss on that rank's data.

Rank 1's batches from step 2 on hold rows whose weights sum to zero, and the loss divides by that sum, so it is nan;
DDP averages the nan gradient into every rank's weights, and from then on every value (validation loss, metrics,
weights) is nan on both ranks. Nothing compared across ranks or runs means anything on top of it: a checker names
the non-finite loss (rank 1, step 2, the training_step line) and judges no value-comparing contract (not "the
checkpoint could not be resumed", not "val_loss is rank 0's alone").
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "walkthrough b11 (a NaN loss reported as a resume and an eval-duplication failure)"
EXPECTED = {"all-rank-save": "pass", "sync-dist": "nofail", "eval-duplication": "nofail", "effective-batch": "nofail",
            "configure-model": "nofail", "shared-writes": "pass"}
EVIDENCE = "not judged: the training loss was nan on rank 1 at step 2 (nonfinite_loss_on_rank_one.py:36)"


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.reg = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        weight = torch.ones(len(y))
        if self.global_rank == 1 and self.global_step >= 2:
            weight = weight * 0  # this rank's rows carry no weight: the division below is 0/0
        loss = ((self.reg(x) - y).pow(2).squeeze(1) * weight).sum() / weight.sum()
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.reg(x), y), sync_dist=True, batch_size=len(y))

    def train_dataloader(self):
        return DataLoader(_rows(32, 8), batch_size=4)

    def val_dataloader(self):
        return DataLoader(_rows(16, 9), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
