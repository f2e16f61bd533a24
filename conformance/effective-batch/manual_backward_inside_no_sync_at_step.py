"""Manual optimization runs its backward inside DDP's no_sync at the step: DDP syncs no gradient.

A variant of Lightning-AI/pytorch-lightning#9237 (replicas stepping on their own gradients): the user copied the
manual-accumulation pattern (`with self.trainer.strategy.model.no_sync(): self.manual_backward(loss)` for the
micro-batches that do not step) but wrapped every backward, the one before `opt.step()` included. DDP's reducer is
not armed inside no_sync, so each rank steps on its own gradient and the replicas drift apart. Nothing raises.
Fix: run the last backward before the step outside no_sync.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant of https://github.com/Lightning-AI/pytorch-lightning/issues/9237"
EXPECTED = {"effective-batch": "fail"}
EVIDENCE = "ran with DDP's gradient sync off (no_sync), so nothing all-reduced the gradients"


class RandomDataset(TensorDataset):
    def __init__(self, size, num_samples):
        g = torch.Generator().manual_seed(41)
        x = torch.randn(num_samples, size, generator=g)
        super().__init__(x, (x[:, 0] > 0.5).float())


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 1)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        loss = (self.layer(x).squeeze(-1) - y).square().mean()
        with self.trainer.strategy.model.no_sync():
            self.manual_backward(loss)
        opt.step()
        self.log("train_loss", loss.detach(), sync_dist=True, batch_size=len(y))

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 64), batch_size=8, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
