"""Violating: the mean of per-batch functional AUROC and accuracy, computed as a plain Python expression.

validation_step computes torchmetrics.functional.auroc and accuracy on the batch and logs (auroc + acc) / 2 as
"val_quality" with sync_dist=True and batch_size, monitored by ModelCheckpoint. The logged value is not itself a
TorchMetrics output, but it is still a per-batch metric: Lightning averages it over batches and ranks, and the
AUROC half of that average is the mean of per-batch AUROCs, not the AUROC of the epoch. The validation blocks each
have their own score offset, so per-batch AUROCs are high while the epoch's ranking is worse.
"""
import lightning.pytorch as L
import torch
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"sync-dist": "fail", "unused-parameters": "pass"}
EVIDENCE = ("'val_quality' = mean of functional auroc and functional accuracy of each batch: auroc is nonlinear; "
            "the logged epoch value vs the mean of the epoch-level metrics over all ranks' samples")


def _train(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] + 0.7 * torch.randn(n, generator=g) > 0.6).long()
    return TensorDataset(x, y)


def _val_blocks(seed):
    g = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for pos, offset in zip([[0, 5], [1, 2, 4], [3, 6], [0, 1, 6, 7]], [-2.0, 2.0, -0.7, 0.9]):
        y = torch.zeros(8, dtype=torch.long)
        y[pos] = 1
        x = torch.randn(8, 6, generator=g) * 0.4
        x[:, 0] += 1.5 * y.float() + offset
        xs.append(x)
        ys.append(y)
    return TensorDataset(torch.cat(xs), torch.cat(ys))


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
        auroc = torchmetrics.functional.auroc(probs, y, task="binary")
        acc = torchmetrics.functional.accuracy(probs, y, task="binary")
        self.log("val_quality", (auroc + acc) / 2, sync_dist=True, batch_size=len(y))

    def train_dataloader(self):
        return DataLoader(_train(64, 71), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_val_blocks(72), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def trainer_kwargs():
    return dict(max_epochs=2, num_sanity_val_steps=0, enable_checkpointing=True,
                callbacks=[ModelCheckpoint(monitor="val_quality", mode="max", save_top_k=1)])
