"""CONFORMING: the fixed reduce_decision_rank_zero_only: every rank joins the decision's all_reduce.

Every rank calls `trainer.strategy.reduce_boolean_decision` with its own flag, so the all_reduce pairs up;
only the printing stays on rank 0.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "conforming"
EXPECTED = {"all-rank-save": "pass"}
EVIDENCE = "every rank calls strategy.reduce_boolean_decision once per validation epoch"


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
        stop = self.trainer.strategy.reduce_boolean_decision(bool(self.last_loss < 1e-6))  # every rank
        if self.trainer.is_global_zero:
            print("CASE: rank 0 decided", stop, flush=True)

    def train_dataloader(self):
        return DataLoader(_split(32, 1), batch_size=8)

    def val_dataloader(self):
        return DataLoader(_split(16, 2), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"max_epochs": 2, "num_sanity_val_steps": 0}
