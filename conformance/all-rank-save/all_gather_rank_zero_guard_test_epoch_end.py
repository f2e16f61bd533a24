"""A test stage gathers its per-rank scores with self.all_gather, but only on rank 0.

The user collects test-step losses and, at the end of the test epoch, wants rank 0 to print the mean over the
whole test set. `self.all_gather` sits under `if self.trainer.is_global_zero:`, so rank 0 enters an all_gather
that rank 1 never joins: rank 0 waits (or pairs with whatever rank 1 calls next). Fit alone never runs this hook,
so a check of fit only passes. Fix: call self.all_gather on every rank, then print on rank 0.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant (issue 19, section 2: every stage)"
EXPECTED = {"all-rank-save": "fail", "data-sharding": "pass"}
EVIDENCE = "self.all_gather called on rank 0 only from Model.on_test_epoch_end under `if self.trainer.is_global_zero:`"


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.losses.append(torch.nn.functional.mse_loss(self.net(x), y).detach())

    def on_test_epoch_end(self):
        local = torch.stack(self.losses)
        if self.trainer.is_global_zero:  # only rank 0 "needs" the scores
            scores = self.all_gather(local)
            print("CASE: test mse over all ranks", float(scores.mean()), flush=True)
        self.losses = []

    def train_dataloader(self):
        return DataLoader(_split(32, 1), batch_size=8)

    def test_dataloader(self):
        return DataLoader(_split(16, 2), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
