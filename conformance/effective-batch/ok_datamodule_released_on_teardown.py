"""CONFORMING: a datamodule that loads its data once and releases it in teardown, and a module hook that reads its
loader's dataset.

The datamodule loads the training rows in setup() the first time only (`if self.rows is None`) and frees them in
teardown("fit"), as datamodules over large arrays do; one datamodule instance goes through setup and teardown once,
as in the user's script. The module's on_train_epoch_start reads `self.trainer.train_dataloader.dataset` to tell the
dataset which epoch it is. A checker's own extra runs must give the module what a user's run gives it: a datamodule
that no earlier run has torn down, and a train loader with the loader's own attributes.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset

SOURCE = "seed"
EXPECTED = {"effective-batch": "pass", "all-rank-save": "pass", "sync-dist": "pass", "unused-parameters": "pass",
            "data-sharding": "pass", "shared-writes": "pass"}
EVIDENCE = "passes: the one-rank reference trains on the same samples with the loader's dataset readable"


class Rows(Dataset):
    def __init__(self, x):
        self.x = x
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.x[i, :2].sum(0, keepdim=True)


class DataModule(L.LightningDataModule):
    def __init__(self):
        super().__init__()
        self.rows = None
        self.loaded = False

    def setup(self, stage):
        if not self.loaded:  # load once per datamodule
            g = torch.Generator().manual_seed(3)
            self.rows = Rows(torch.randn(32, 5, generator=g))
            self.loaded = True

    def teardown(self, stage):
        if stage == "fit":
            self.rows = None  # release the arrays once training is over

    def train_dataloader(self):
        return DataLoader(self.rows, batch_size=4, shuffle=True)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.reg = torch.nn.Linear(5, 1)

    def on_train_epoch_start(self):
        self.trainer.train_dataloader.dataset.set_epoch(self.current_epoch)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.reg(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
