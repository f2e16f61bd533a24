"""A DeepSpeed config ported from a bigger cluster keeps an explicit train_batch_size.

The user copied the DeepSpeed JSON of a 4-GPU job (train_batch_size 32 = 8 per GPU x 4 GPUs) into their
DeepSpeedStrategy and now trains on 2 devices. DeepSpeed checks train_batch_size == micro-batch x accumulation x
world size when the engine is built (8 x 1 x 2 = 16 here) and stops every rank with an AssertionError from inside
deepspeed, before the first step. Fix: drop train_batch_size (Lightning derives the global batch from the
DataLoader, accumulate_grad_batches and the world size) or set it to 16 for this world.
"""
import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "issue 12"
STRATEGY = "deepspeed"
EXPECTED = {"strategy-config": "fail"}
EVIDENCE = ("DeepSpeed rejected the config: `train_batch_size` 32 is not micro-batch 8 x accumulation 1 x world "
            "size 2, at the line of the config dict that sets it")

DS_CONFIG = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 8,
    "zero_optimization": {"stage": 2},
}


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def train_dataloader(self):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(64, 8, generator=g)
        return DataLoader(TensorDataset(x, x[:, :2].sum(1, keepdim=True)), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def trainer_kwargs():
    return {"strategy": DeepSpeedStrategy(config=DS_CONFIG)}
