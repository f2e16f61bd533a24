"""Manual optimization calls `loss.backward()` instead of `self.manual_backward(loss)`: DDP syncs no gradient.

Rebuilt from Lightning-AI/pytorch-lightning#9237 ("Manual Optimization does not synchronize gradients in DDP"): the
user's `training_step` with `automatic_optimization = False` did `opt.zero_grad()`, computed the loss, called
`loss.backward()` and `opt.step()`, and printed each rank's weights: they differed between ranks. Under manual
optimization Lightning turns DDP's gradient sync off in the forward and turns it back on only inside
`self.manual_backward` (which prepares DDP's reducer); a plain `loss.backward()` fills each rank's own gradients and
the ranks step on them, so the replicas drift apart silently. Nothing raises.
Fix: call `self.manual_backward(loss)` (it runs the backward through the strategy, which all-reduces the gradients).
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "https://github.com/Lightning-AI/pytorch-lightning/issues/9237"
EXPECTED = {"effective-batch": "fail"}
EVIDENCE = "is a plain loss.backward(), not run by the strategy, so DDP's reducer was not armed"


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
        loss.backward()
        opt.step()
        self.log("train_loss", loss.detach(), sync_dist=True, batch_size=len(y))

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 64), batch_size=8, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
