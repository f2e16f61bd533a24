"""Validation accuracy over a padded 5-sample set, logged without sync_dist: rank 0 publishes its own.

Lightning inserts its DistributedSampler, which pads 5 indices to 6 by repeating index 0 on rank 1, and
the user logs a per-batch accuracy without sync_dist, so each rank keeps the accuracy of its own shard and
rank 0's is what is published. Sample 0 is evaluated twice, yet rank 0's value holds it once: how far the
published value is from the one-device value is rank 0's shard alone, not the duplicate. A checker must
say whose value it compares (rank 0's, the other ranks' beside it), not "on 2 ranks", and which part of
the run the difference comes from. Fix: shard validation without padding and sync the metric (or use a
TorchMetrics object), or publish from devices=1.
"""
import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

SOURCE = "issue 32 (R26 with the metric unsynced)"
PLAIN_DRIVER = "validate"  # same seeded weights in every world, so world sizes compare directly
EXPECTED = {"eval-duplication": "fail", "unused-parameters": "pass", "data-sharding": "pass"}
EVIDENCE = ("validation sample index 0 evaluated twice: 6 evaluations for 5 samples; val_acc `on rank 0 (rank 1:` "
            "... `vs` the one-device value; the difference is `rank 0's shard alone (rank-local)`")


class Points(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=g)
        self.y = (self.x[:, 0] + 0.5 * torch.randn(n, generator=g) > 0).long()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(Points(16, seed=1), batch_size=4)

    def val_dataloader(self):
        return DataLoader(Points(5, seed=2), batch_size=3)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 2)
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, idx = batch
        acc = (self.net(x).argmax(dim=1) == y).float().mean()
        self.log("val_acc", acc, batch_size=len(y))  # not synced: each rank keeps its own
        self.seen += idx.tolist()

    def on_validation_epoch_end(self):
        print("CASE: rank", self.global_rank, "evaluated val indices", self.seen, flush=True)
        self.seen = []

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
