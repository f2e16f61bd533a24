"""A step's loss copied to the CPU with .cpu() is averaged across ranks with trainer.strategy.reduce.

To keep a running average off the GPU the user writes
`mean = self.trainer.strategy.reduce(loss.detach().cpu(), reduce_op="mean")` in training_step. On GPU ranks
.cpu() makes a CPU copy, and Lightning's reduce all-reduces it as it is: under NCCL that raises "No backend
type associated with device type cpu". On CPU ranks .cpu() returns the tensor itself and gloo reduces it, so
this run is clean.
Fix: reduce the tensor on its device, then move the result: strategy.reduce(loss.detach()).cpu().
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant (issue 34: a .cpu() copy given to Lightning's strategy.reduce)"
EXPECTED = {"device-placement": "fail", "unused-parameters": "pass"}
EVIDENCE = "a .cpu() copy made in training_step reaches `all_reduce` on the CPU"


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    return TensorDataset(x, x[:, :1] - x[:, 1:2])


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.reg = torch.nn.Linear(5, 1)
        self.running = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.reg(x), y)
        mean = self.trainer.strategy.reduce(loss.detach().cpu(), reduce_op="mean")
        self.running.append(float(mean))
        return loss

    def train_dataloader(self):
        return DataLoader(_data(32, 4), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
