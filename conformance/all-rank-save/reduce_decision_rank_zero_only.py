"""A module asks the strategy to agree on an early-stop decision, but only from rank 0.

`trainer.strategy.reduce_boolean_decision(flag)` all-reduces the flag across ranks so that every rank
takes the same decision. The user only wants rank 0 to "own" the decision and puts the call under
`if self.trainer.is_global_zero:`, so rank 0 enters an all_reduce that rank 1 never joins: the world
hangs or mismatches collectives. Fix: call reduce_boolean_decision on every rank, each with its own
value, and act on the reduced result everywhere.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"all-rank-save": "fail"}
EVIDENCE = ("strategy.reduce_boolean_decision called on rank 0 only from Model.on_validation_epoch_end under an "
            "`if self.trainer.is_global_zero:` guard")


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.last_loss = torch.tensor(0.0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.last_loss = torch.nn.functional.mse_loss(self.net(x), y)

    def on_validation_epoch_end(self):
        if self.trainer.is_global_zero:  # only rank 0 "decides"
            stop = self.trainer.strategy.reduce_boolean_decision(bool(self.last_loss < 1e-6))
            print("CASE: rank 0 decided", stop, flush=True)

    def train_dataloader(self):
        return DataLoader(_split(32, 1), batch_size=8)

    def val_dataloader(self):
        return DataLoader(_split(16, 2), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"max_epochs": 2, "num_sanity_val_steps": 0}
