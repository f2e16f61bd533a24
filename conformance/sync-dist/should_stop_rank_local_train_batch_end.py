"""Violating: trainer.should_stop set in on_train_batch_end from a value only rank 0 has.

The user keeps a running list of training losses on rank 0 only (where it is printed) and stops training once the
mean of the last three is below a target. The decision is taken on rank 0 alone: rank 0 leaves the training loop
after its third batch and goes on to validation and the end of fit, while rank 1 runs its next training step and
waits in DDP's gradient all-reduce for a partner that is doing something else. The world hangs or dies; the cause
is a decision every rank needs, taken on one rank.
Fix: reduce the flag across ranks (trainer.strategy.reduce_boolean_decision) before setting should_stop.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"sync-dist": "fail"}
EVIDENCE = ("trainer.should_stop = True on rank 0 only, in on_train_batch_end at global step 3 (epoch 0), with the "
            "file:line of the assignment; rank 1 still False at that step")


def _train():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 6, generator=g)
    y = (x[:, 0] > 0).float()
    return TensorDataset(x, y)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        self.recent = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.binary_cross_entropy_with_logits(self.net(x).squeeze(1), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.trainer.is_global_zero:  # bookkeeping on the rank that prints
            self.recent.append(float(outputs["loss"]))
            if len(self.recent) >= 3 and sum(self.recent[-3:]) / 3 < 10.0:
                self.trainer.should_stop = True

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.binary_cross_entropy_with_logits(self.net(x).squeeze(1), y)
        self.log("val_loss", loss, sync_dist=True, batch_size=len(y))

    def train_dataloader(self):
        return DataLoader(_train(), batch_size=4, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_train(), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer_kwargs():
    return dict(max_epochs=2, num_sanity_val_steps=0, enable_checkpointing=False)
