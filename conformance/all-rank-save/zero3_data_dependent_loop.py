"""A decode loop in validation_step that stops on a per-rank condition, under DeepSpeed ZeRO stage 3.

The module refines each validation batch step by step until every sequence of the batch has ended
(`while not done.all():`), as a generate loop does. Under ZeRO-3 every rank holds a partition of the
decoder's weights, and each forward through it gathers them from every rank: a gather is a collective.
Each rank tests its own batch, so the rank whose sequences are longer runs more forwards than the other,
and the ranks' gathers stop pairing up: the world hangs (or the gathers pair with unrelated collectives and
mix values). Fix: decide the stop on every rank together (all_reduce the per-rank "not done" flag with MAX),
so every rank keeps running the forward until all ranks are done.
"""
import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "issue 32"
EXPECTED = {"all-rank-save": "fail"}
EVIDENCE = ("the loop `while not done.all():` (validation_step), each rank's gather count, and the fix: a synced stop "
            "(`all_reduce` of the flag with MAX)")


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    # How many decode steps each sequence takes: 2 for the even samples, 4 for the odd ones (rank 0's
    # validation shard gets the even ones, rank 1's the odd ones).
    lengths = torch.tensor([2, 4] * (n // 2))
    return TensorDataset(x, x[:, :3].sum(1, keepdim=True), lengths)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(8, 8)
        self.decoder = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return torch.nn.functional.mse_loss(self.head(self.decoder(self.encoder(x))), y)

    def validation_step(self, batch, batch_idx):
        x, y, lengths = batch
        h = self.encoder(x)
        t = 0
        done = lengths <= t
        while not done.all():
            h = torch.tanh(self.decoder(h))
            t += 1
            done = lengths <= t
        loss = torch.nn.functional.mse_loss(self.head(h), y)
        self.log("val_loss", loss, sync_dist=True, batch_size=len(y))

    def train_dataloader(self):
        return DataLoader(_split(32, 5), batch_size=8)

    def val_dataloader(self):
        return DataLoader(_split(16, 6), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def trainer_kwargs():
    return dict(max_epochs=1, strategy=DeepSpeedStrategy(stage=3), num_sanity_val_steps=0)
