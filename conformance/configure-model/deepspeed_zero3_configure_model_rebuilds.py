"""Under DeepSpeed ZeRO stage 3, configure_model builds fresh layers on every call: validate after fit runs an
untrained model.

The user creates the network inside configure_model, as recommended for ZeRO-3 (Lightning calls it inside
deepspeed.zero.Init, so the layers are partitioned as they are created), but without
checking whether it already exists. Lightning calls the hook at the start of every fit, validate, test and
predict, so after fit the following validate replaces the trained layers with newly initialised ones:
no error, just a validation score from random weights, partitioned afresh by DeepSpeed.
Fix: return early when the layers exist (if self.body is not None: return).
"""
import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "R25 (under DeepSpeed ZeRO-3)"
PLAIN_DRIVER = "fit,validate"
EXPECTED = {"configure-model": "fail", "sync-dist": "pass", "data-sharding": "pass"}
EVIDENCE = "configure_model called twice (fit, then validate) replaced every parameter of body"


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x[:, :2] * 3.0)


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(_data(32, seed=61), batch_size=4)

    def val_dataloader(self):
        return DataLoader(_data(8, seed=62), batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = None

    def configure_model(self):
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        print("CASE: rank", self.global_rank, "configure_model during", self.trainer.state.fn.value, flush=True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.body(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.body(x), y), sync_dist=True, batch_size=len(y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"max_epochs": 4, "limit_train_batches": 1.0, "strategy": DeepSpeedStrategy(stage=3)}
