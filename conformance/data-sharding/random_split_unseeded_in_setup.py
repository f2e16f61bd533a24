"""A datamodule splits its dataset with random_split in setup() and no generator: each rank draws its own split.

The user loads 64 labelled rows and, in setup(), splits them 48/16 into training and validation with
`random_split(full, [48, 16])`, which draws its permutation from torch's global generator. Their notebook calls
seed_everything, so every process drew the same split there; the cluster job is launched by torchrun without it,
so each rank draws a different permutation: the ranks' training splits overlap, rank 1 trains on samples that are
in rank 0's validation split, and some samples are in no split at all. Lightning's DistributedSampler then shares
each rank's *own* split out, assuming the same dataset on every rank (the report: validation accuracy on the
cluster far above the single-GPU run).
Fix: random_split(full, [48, 16], generator=torch.Generator().manual_seed(42)), or seed_everything in the script.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset, random_split

SOURCE = "issue 38 (a field trial's rebuilt report of an unseeded random_split in setup)"
EXPECTED = {"data-sharding": "fail", "sync-dist": "pass", "unused-parameters": "pass", "all-rank-save": "pass"}
EVIDENCE = ("the training data differs by rank: the split drawn by `random_split` at its setup() line from the global "
            "generator, the samples the ranks' training splits share and rank 0's validation samples in rank 1's "
            "training split")


class DataModule(L.LightningDataModule):
    def setup(self, stage):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(64, 6, generator=g)
        full = TensorDataset(x, x[:, :2].sum(1, keepdim=True))
        self.train_set, self.val_set = random_split(full, [48, 16])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=4, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(6, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True, batch_size=len(y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
