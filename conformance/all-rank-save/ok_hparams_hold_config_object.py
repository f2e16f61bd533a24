"""CONFORMING: save_hyperparameters() with a config dataclass among the init args.

The module takes its settings as a dataclass (`Model(config=Config(...))`) and calls save_hyperparameters(),
so the Config object is pickled into every checkpoint. torch's weights_only loading (the default since torch
2.6, used by Lightning on resume) refuses that class, on one device as on many: a resume matter, not a
distributed save. Nothing here saves or gathers from one rank only, so all-rank-save passes; its verdict notes
the refused class and the fix (store plain values in hparams, or weights_only=False for a trusted checkpoint).
"""
import dataclasses

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "conforming"
EXPECTED = {"all-rank-save": "pass"}
EVIDENCE = "passes, with a note naming the refused class Config (hparams['config'])"


@dataclasses.dataclass
class Config:
    hidden: int = 8
    lr: float = 0.05


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


class Model(L.LightningModule):
    def __init__(self, config: Config = Config()):  # noqa: B008  (as the user wrote it)
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, config.hidden), torch.nn.Tanh(),
                                       torch.nn.Linear(config.hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        return DataLoader(_split(32, 1), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.config.lr)


def trainer_kwargs():
    return {"max_epochs": 1}
