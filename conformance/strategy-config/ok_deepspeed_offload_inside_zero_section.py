"""The conforming twin of deepspeed_offload_block_outside_zero_section.py: the offload block inside "zero_optimization".

The same ZeRO-2 config with "offload_optimizer" where DeepSpeed reads it; nothing to report.
"""
import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "twin of microsoft/DeepSpeed#1935"
STRATEGY = "deepspeed"
EXPECTED = {"strategy-config": "pass", "sync-dist": "pass", "unused-parameters": "pass"}

DS_CONFIG = {
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 10_000_000,
        "reduce_scatter": True,
        "reduce_bucket_size": 10_000_000,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    },
}


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(191)
        x = torch.randn(32, 10, generator=g)
        return DataLoader(TensorDataset(x, x[:, :3].mean(1, keepdim=True)), batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.mlp(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def trainer_kwargs():
    return {"strategy": DeepSpeedStrategy(config=DS_CONFIG)}
