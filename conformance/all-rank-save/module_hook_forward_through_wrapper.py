"""The module's own hook runs a rank-0 sanity forward through `self.trainer.model` (the DDP wrapper).

A variant of rank_zero_preview_through_ddp_wrapper without any barrier: at the end of each training epoch the
LightningModule checks its predictions on a fixed batch on rank 0 only. `self.trainer.model` is the
DistributedDataParallel wrapper, whose forward broadcasts the BatchNorm buffers from rank 0: a collective that
only rank 0 makes, so rank 0's broadcast pairs with whatever collective rank 1 makes next (the next epoch's
buffer broadcast), and from there on the ranks' collectives are shifted by one. Fix: forward through `self`
(the unwrapped module) on rank 0, or run the check on every rank.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"all-rank-save": "fail"}
EVIDENCE = ("DistributedDataParallel.forward (broadcasts buffers) called on rank 0 only from "
            "Model.on_train_epoch_end under an `if self.global_rank == 0:` guard")


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
        self.check = torch.randn(4, 6, generator=torch.Generator().manual_seed(5))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def on_train_epoch_end(self):
        if self.global_rank == 0:
            with torch.no_grad():
                out = self.trainer.model(self.check)
            print("CASE: rank 0 check", out.argmax(1).tolist(), flush=True)

    def train_dataloader(self):
        return DataLoader(_data(32, 7), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"max_epochs": 2}
