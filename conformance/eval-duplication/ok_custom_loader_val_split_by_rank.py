"""CONFORMING: a package's own loader class (no sampler) gives each rank its own share of the validation set.

Twin of custom_loader_whole_val_every_rank.py: the same dict-of-tensors loader, but it keeps rows rank,
rank + world, ... of the validation set, so the two ranks' validation loops receive different batches and
every sample is evaluated once. The logged loss is a mean synced with sync_dist=True.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "conforming"
PLAIN_DRIVER = "fit,validate"
EXPECTED = {"eval-duplication": "pass"}
EVIDENCE = "validation: no batch reached two ranks (compared by content: DictLoader without a sampler)"


class DictLoader:
    """Batches of this rank's rows of a dict of tensors (rows rank, rank + world, ...)."""

    def __init__(self, data: dict, batch_size: int):
        rank, world = 0, 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.data = {k: v[rank::world] for k, v in data.items()}
        self.batch_size = batch_size
        self.n = len(next(iter(self.data.values())))

    def __len__(self):
        return (self.n + self.batch_size - 1) // self.batch_size

    def __iter__(self):
        for start in range(0, self.n, self.batch_size):
            yield {k: v[start:start + self.batch_size] for k, v in self.data.items()}


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return x, x @ torch.linspace(-1, 1, 6)[:, None]


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(TensorDataset(*_data(32, 1)), batch_size=4)

    def val_dataloader(self):
        x, y = _data(12, 2)
        return DictLoader({"data": x, "target": y}, batch_size=2)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(6, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self.net(batch["data"]), batch["target"])
        self.log("valid_loss", loss, sync_dist=True, batch_size=len(batch["data"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
