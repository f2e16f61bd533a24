"""The DeepSpeed config tunes the ZeRO bucket sizes at the top level, beside "zero_optimization": not read.

A variant of deepspeed_offload_block_outside_zero_section.py with other ZeRO keys: to cut the communication buffers of
a ZeRO-2 run, the user writes "reduce_bucket_size" and "allgather_bucket_size" next to the ZeRO section instead of in
it. DeepSpeed reads them only inside "zero_optimization" and ignores unknown top-level keys, so the run keeps the
5e8-element default buckets and the memory the user budgeted for is not there. Fix: move both keys into the section.
"""
import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant of microsoft/DeepSpeed#1935 (misplaced ZeRO keys)"
STRATEGY = "deepspeed"
EXPECTED = {"strategy-config": "fail", "sync-dist": "pass", "unused-parameters": "pass"}
EVIDENCE = ('DeepSpeed config key "reduce_bucket_size" at the top level is not read: ZeRO settings belong in '
            '"zero_optimization", which keeps the default 500000000')

DS_CONFIG = {
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
    "reduce_bucket_size": 20_000_000,  # belongs inside "zero_optimization"
    "allgather_bucket_size": 20_000_000,
}


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(193)
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
