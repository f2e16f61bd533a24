"""A DataLoader with spawned workers gets a worker_init_fn defined inside train_dataloader: it cannot be pickled.

The user seeds each DataLoader worker with a small closure defined inside train_dataloader (it captures an offset)
and starts the workers with multiprocessing_context="spawn" (their dataset holds a handle a forked worker must not
inherit). A spawned worker receives the dataset, the collate_fn and the worker_init_fn pickled, and a function
defined inside another function does not pickle: the first epoch stops with "Can't pickle local object
'Model.train_dataloader.<locals>.seed_worker'", which Lightning then hides behind its own "Please call
`iter(combined_loader)` first" while tearing down.
Fix: define the worker_init_fn at module level (functools.partial of it for arguments).
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "issue 38 (a field trial's rebuilt report of a local worker_init_fn with spawned workers)"
EXPECTED = {"spawn-safety": "fail"}
EVIDENCE = ("`train_dataloader().worker_init_fn` does not pickle: a function defined inside Model.train_dataloader; "
            "the workers start by spawn (`multiprocessing_context='spawn'`)")


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x[:, :2].sum(1, keepdim=True))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(6, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        offset = 7

        def seed_worker(worker_id):
            torch.manual_seed(offset + worker_id)

        return DataLoader(_rows(32, 1), batch_size=4, num_workers=1, worker_init_fn=seed_worker,
                          multiprocessing_context="spawn")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
