"""Two faults: a validation metric synced on rank 0 only, and a block that never reaches the loss.

on_validation_epoch_end logs the accuracy with sync_dist=True inside `if self.trainer.is_global_zero:`,
so the world stops in the sanity check, before any training step. The unused `aux` block would only
fail DDP's reducer at the second training step, which that world never reaches: the checker has to
judge unused-parameters on a fit that steps around the validation fault, not leave it unjudged.
Fix: log on every rank; delete or freeze `aux`.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    return TensorDataset(x, (x[:, :3].sum(1) > 0).long())


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU())
        self.aux = torch.nn.Linear(16, 16)  # left over from an experiment; forward no longer calls it
        self.classifier = torch.nn.Linear(16, 2)
        self.correct, self.seen = 0, 0

    def forward(self, x):
        return self.classifier(self.encoder(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.correct += int((self(x).argmax(1) == y).sum())
        self.seen += len(y)

    def on_validation_epoch_end(self):
        if self.trainer.is_global_zero:
            self.log("val_acc", self.correct / max(self.seen, 1), sync_dist=True)
        self.correct, self.seen = 0, 0

    def train_dataloader(self):
        return DataLoader(_split(64, 1), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_split(32, 2), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


EXPECTED = {"sync-dist": "fail", "unused-parameters": "fail", "all-rank-save": "pass", "data-sharding": "pass"}
EVIDENCE = "the rank-0-only synced log in on_validation_epoch_end, and the aux block without gradients"
