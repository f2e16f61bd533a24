"""CONFORMING: DeepSpeed ZeRO stage 2 with DeepSpeed's FusedAdam and two parameter groups.

The module returns deepspeed.ops.adam.FusedAdam from configure_optimizers, with weight decay on the weights
and none on the biases, and saves on every rank. FusedAdam needs DeepSpeed's compiled kernels, which a CPU
rank cannot build quickly; the CPU deepspeed tier runs it as torch.optim.AdamW with the same two parameter
groups and hyper-parameters, and says so in the item's note. A checker must pass here.
"""
import lightning.pytorch as L
import torch
from deepspeed.ops.adam import FusedAdam
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "issue 12"
STRATEGY = "deepspeed"
EXPECTED = {"all-rank-save": "pass"}


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(5)
        x = torch.randn(64, 8, generator=g)
        return DataLoader(TensorDataset(x, x[:, :2].sum(1, keepdim=True)), batch_size=8)

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        no_decay = [p for n, p in self.named_parameters() if n.endswith("bias")]
        return FusedAdam([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                         lr=3e-3, betas=(0.9, 0.95), eps=1e-6)


def trainer_kwargs():
    return {"max_epochs": 1, "strategy": DeepSpeedStrategy(stage=2)}
