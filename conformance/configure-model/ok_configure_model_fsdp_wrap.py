"""CONFORMING: under FSDP, configure_model builds the blocks inside the sharded context and wraps each one,
once; the validate after fit reuses them.

configure_model runs inside the strategy's sharded context, so wrap() there makes every block its own FSDP
unit (sharded as soon as it is created). The "already built" guard makes the second call (validate after fit)
return early: same FSDP units, same trained shards, and validate scores the trained model. A checker must pass
configure-model under the CPU sharded tier, with configure_model called inside that context.
"""
import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp.wrap import wrap
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
STRATEGY = "fsdp"
EXPECTED = {"configure-model": "pass", "all-rank-save": "pass", "sync-dist": "pass"}
EVIDENCE = ("configure_model called twice (fit, then validate), later calls kept every parameter; "
            "validate after fit used the trained weights")


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x[:, :2] * 1.5)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.blocks = None

    def configure_model(self):
        if self.blocks is not None:
            return
        self.blocks = torch.nn.Sequential(
            wrap(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU())),
            wrap(torch.nn.Linear(32, 2)),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.blocks(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.blocks(x), y), sync_dist=True, batch_size=len(y))

    def train_dataloader(self):
        return DataLoader(_data(32, 1), batch_size=4)

    def val_dataloader(self):
        return DataLoader(_data(16, 2), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def trainer_kwargs():
    return dict(max_epochs=2, strategy=FSDPStrategy())
