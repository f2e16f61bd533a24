"""CONFORMING twin of worker_init_fn_defined_in_loader_hook: the worker_init_fn is a module-level function.

Same spawned DataLoader workers (multiprocessing_context="spawn"), but the worker_init_fn is functools.partial of
a function defined at module level, which pickles by reference: every worker starts (once per fit: persistent
workers), and spawn-safety says what the workers received.
"""
import functools

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "conforming (fix of worker_init_fn_defined_in_loader_hook)"
EXPECTED = {"spawn-safety": "pass", "data-sharding": "pass", "all-rank-save": "pass"}
EVIDENCE = "passes: what the spawned workers of train_dataloader receive pickles"


def seed_worker(worker_id, offset):
    torch.manual_seed(offset + worker_id)


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
        return DataLoader(_rows(32, 1), batch_size=4, num_workers=1,
                          worker_init_fn=functools.partial(seed_worker, offset=7), multiprocessing_context="spawn",
                          persistent_workers=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
