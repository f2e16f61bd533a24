"""CONFORMING: a decode loop in validation_step under DeepSpeed ZeRO stage 3 whose stop every rank decides together.

The twin of zero3_data_dependent_loop.py: the same model, data and loop, but the loop tests a flag that every
rank reduces with MAX before testing it (`all_reduce` of "some sequence on some rank is not done"), so every rank
runs the forward (and its ZeRO-3 parameter gathers) the same number of times: rank 0, done after 2 steps, runs
2 more and keeps its finished states (masked). A checker must pass here.
"""
import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "issue 32"
EXPECTED = {"all-rank-save": "pass"}


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
        running = self._any_rank_running(lengths, t)
        while running:
            h = torch.where((lengths > t)[:, None], torch.tanh(self.decoder(h)), h)
            t += 1
            running = self._any_rank_running(lengths, t)
        loss = torch.nn.functional.mse_loss(self.head(h), y)
        self.log("val_loss", loss, sync_dist=True, batch_size=len(y))

    def _any_rank_running(self, lengths, t):
        flag = (lengths > t).any().float()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag > 0)

    def train_dataloader(self):
        return DataLoader(_split(32, 5), batch_size=8)

    def val_dataloader(self):
        return DataLoader(_split(16, 6), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def trainer_kwargs():
    return dict(max_epochs=1, strategy=DeepSpeedStrategy(stage=3), num_sanity_val_steps=0)
