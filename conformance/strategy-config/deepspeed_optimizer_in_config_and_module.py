"""The DeepSpeed config dict brings its own optimizer and fp16 section; the module also has both.

The user's DeepSpeed JSON (from an earlier project) defines an AdamW optimizer and enables fp16, while the
LightningModule's configure_optimizers returns its own AdamW and the Trainer stays at 32-true. Lightning builds the
optimizer from the config and warns only at GPU setup; the fp16 section makes DeepSpeed train in half precision
although the Trainer believes it is full precision. Fix: one owner for each: drop "optimizer" and "fp16" from the
dict and set Trainer(precision="16-mixed") if half precision is wanted.
"""
import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"strategy-config": "fail", "sync-dist": "pass"}
EVIDENCE = ("the DeepSpeed config defines optimizer (AdamW) while configure_optimizers also returns AdamW; "
            "the config enables fp16 while Trainer precision is 32-true")

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
    "fp16": {"enabled": True, "loss_scale": 0},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000},
}


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(19)
        x = torch.randn(32, 8, generator=g)
        return DataLoader(TensorDataset(x, x[:, :2].sum(dim=1, keepdim=True)), batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.mlp(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def trainer_kwargs():
    return {"strategy": DeepSpeedStrategy(config=DS_CONFIG)}
