"""A package's own loader class (not a torch DataLoader, no sampler) hands every rank the whole validation set.

Rebuilt from mlcolvar 1.3.1 (data/dataloader.py DictLoader, data/datamodule.py DictModule): the datamodule
splits a dictionary of tensors into training and validation parts and serves each through its own loader
class, which slices the tensors into batches itself. Lightning only replaces the sampler of a torch
DataLoader, so under DDP every rank iterates the whole validation set: each sample is evaluated world-size
times and the validation epoch is no faster on 2 devices. The loader hands out no dataset indices, so the
duplication shows only in what each rank's validation loop receives. Fix: let the loader take this rank's
share (rows rank, rank + world, ...), or serve validation through a DataLoader that Lightning can shard.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "mlcolvar 1.3.1 data/dataloader.py DictLoader (field trial, issue #19)"
PLAIN_DRIVER = "fit,validate"
EXPECTED = {"eval-duplication": "fail"}
EVIDENCE = ("validation: the 3 batches each rank's loop receives are the same on both ranks (DictLoader without a "
            "sampler; established by content)")


class DictLoader:
    """Batches of a dict of tensors, in order; knows nothing of ranks."""

    def __init__(self, data: dict, batch_size: int):
        self.data, self.batch_size = data, batch_size
        self.n = len(next(iter(data.values())))

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
        return DictLoader({"data": x, "target": y}, batch_size=4)


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
