"""A head's scale parameter is switched off by the module's own hook, and the head is called as
`self.head.forward(x)`.

`on_train_batch_start` keeps the head's `scale` frozen for the first epoch
(`self.head.scale.requires_grad_(...)`), so in epoch 0 no backward gives it a gradient; under DDP
with find_unused_parameters=False the reducer then waits for that gradient and the next step fails.
The head is called through `.forward()` directly, which runs it (its parameters are used) but fires
none of its hooks. A checker must say where requires_grad was switched off (this file's hook, not
Lightning's toggle_optimizer) and must not say the head never ran. Fix: freeze it for the whole
run, or let DDP know usage changes (find_unused_parameters=True).
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "issue 32 (a field trial's module, rebuilt)"


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x.sum(1) > 0).long())


class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(6))
        self.out = torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.out(x * self.scale)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(6, 6)
        self.head = Head()

    def forward(self, x):
        return self.head.forward(torch.relu(self.body(x)))  # hooks of self.head are bypassed

    def on_train_batch_start(self, batch, batch_idx):
        self.head.scale.requires_grad_(self.current_epoch > 0)  # warm-up: train the scale from epoch 1

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def train_dataloader(self):
        return DataLoader(_data(64, 1), batch_size=8, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


EXPECTED = {"unused-parameters": "fail"}
EVIDENCE = ("'head.scale' got no gradient in the epoch-0 steps: requires_grad was switched off for it at this "
            "file's `Model.on_train_batch_start`; the head ran (its parameters were used), so no 'never ran'")
