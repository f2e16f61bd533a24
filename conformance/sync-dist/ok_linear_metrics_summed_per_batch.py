"""Conforming: a monitored score that sums per-batch functional accuracy and mean squared error.

validation_step logs accuracy + MSE of each batch (both TorchMetrics functions) as "val_score" with sync_dist=True
and batch_size. Both are means over the batch's samples, so Lightning's batch-size-weighted mean over batches and
ranks is exactly the epoch's accuracy + MSE over all samples: per-batch logging of linear metrics is correct, and
a checker must not fail it (only nonlinear parts such as AUROC or F1 make a per-batch value wrong).
"""
import lightning.pytorch as L
import torch
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"sync-dist": "pass", "unused-parameters": "pass"}
EVIDENCE = "passes: accuracy and MSE are linear in the samples; their per-batch mean is the epoch value"


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] + 0.7 * torch.randn(n, generator=g) > 0.3).long()
    return TensorDataset(x, y)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.binary_cross_entropy_with_logits(self.net(x).squeeze(1), y.float())
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        probs = self.net(x).squeeze(1).sigmoid()
        acc = torchmetrics.functional.accuracy(probs, y, task="binary")
        mse = torchmetrics.functional.mean_squared_error(probs, y.float())
        self.log("val_score", torch.stack([acc, mse]).sum(), sync_dist=True, batch_size=len(y))

    def train_dataloader(self):
        return DataLoader(_split(64, 11), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_split(40, 12), batch_size=6)  # 20 per rank: batches of 6, 6, 6, 2

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def trainer_kwargs():
    return dict(max_epochs=2, num_sanity_val_steps=0, enable_checkpointing=True,
                callbacks=[ModelCheckpoint(monitor="val_score", mode="max", save_top_k=1)])
