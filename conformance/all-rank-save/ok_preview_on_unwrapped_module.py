"""CONFORMING: the fixed rank_zero_preview_through_ddp_wrapper: the rank-0 preview runs on the unwrapped module.

Same callback and model; the preview now calls `pl_module(...)`, the LightningModule itself, which makes no
collective, so only the barrier (called on every rank) pairs up.

The original report:

At the end of each training epoch the user's callback predicts a fixed preview batch on rank 0 (to plot it) and
then calls the strategy barrier so the other ranks wait for it. The preview goes through `trainer.model`, which is
the DistributedDataParallel wrapper, not the LightningModule. The model has BatchNorm, and DDP's forward starts by
broadcasting the module buffers from rank 0: a collective that only rank 0 enters, while rank 1 is in the
barrier. The ranks' collective sequences no longer match and the world hangs or errors (the report, in plain DDP:
validation on rank 0 only plus barrier() hangs; the answer was to use model.module for the rank-0 forward).
Fix: run rank-0-only inference on the unwrapped module (pl_module, or trainer.model.module) or run it on every rank.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "conforming"
EXPECTED = {"all-rank-save": "pass", "unused-parameters": "pass", "shared-writes": "pass"}
EVIDENCE = "every rank calls strategy.barrier once per epoch; the preview makes no collective"


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] * x[:, 1] > 0).long())


class PreviewPlot(L.Callback):
    def __init__(self):
        self.preview = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            with torch.no_grad():
                logits = pl_module(self.preview.to(pl_module.device))  # the unwrapped module
            print("CASE: rank 0 preview predictions", logits.argmax(1).tolist(), flush=True)
        trainer.strategy.barrier()  # everybody waits for the plot
        print("CASE: rank", trainer.global_rank, "passed the preview barrier", flush=True)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 2))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def train_dataloader(self):
        return DataLoader(_data(64, 111), batch_size=8, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"callbacks": [PreviewPlot()]}
