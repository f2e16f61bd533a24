"""CONFORMING: a mean-reduced loss with gradient accumulation; the epoch ends in a partial window.

36 samples on 2 ranks are 18 per rank: 5 batches of 4 with a last batch of 2, and accumulate_grad_batches=2
leaves the epoch's last optimizer step with 1 of 2 micro-batches. Both are accounting facts to report, not
faults: the mean-reduced loss gives the same first-step gradient on 2 ranks x batch 4 as on 1 rank x batch 8.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"effective-batch": "pass", "data-sharding": "pass", "sync-dist": "pass", "shared-writes": "pass"}
EVIDENCE = ("effective batch 16 = 4 x 2 x 2; partial final window (5 batches per rank, accumulation 2); "
            "uneven last batch of 2 per rank")


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(31)
        x = torch.randn(36, 5, generator=g)
        return DataLoader(TensorDataset(x, x @ torch.linspace(-1, 1, 5).unsqueeze(1)), batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"accumulate_grad_batches": 2}
