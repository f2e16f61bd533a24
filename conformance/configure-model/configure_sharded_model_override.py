"""The model is built in the deprecated configure_sharded_model hook (code written for Lightning 1.x).

Lightning 2.6.6 still calls configure_sharded_model for compatibility, but the hook is deprecated in favour of
configure_model, and under FSDPStrategy an override makes Lightning assume every layer was already wrapped by
hand, so it skips wrapping the whole model (nothing here is wrapped: no sharding at all). The body has no
"already built" guard either. Fix: rename it to configure_model, return early when the layers exist, and let
the strategy wrap (auto_wrap_policy).
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"configure-model": "fail", "sync-dist": "pass"}
EVIDENCE = ("Model.configure_sharded_model is overridden (file:line): deprecated; rename it to an idempotent "
            "configure_model")


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x[:, :1] * 2.0)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = None

    def configure_sharded_model(self):
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.body(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.body(x), y), sync_dist=True, batch_size=len(y))

    def train_dataloader(self):
        return DataLoader(_data(32, 1), batch_size=4)

    def val_dataloader(self):
        return DataLoader(_data(16, 2), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
