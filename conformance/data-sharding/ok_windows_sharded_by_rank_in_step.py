"""CONFORMING: every rank loads the whole (small) set of series and training_step shards the windows by rank.

Rebuilt from neuralforecast 3.3.0's multivariate models (TSMixer & co., common/_base_model.py:628 sets
use_distributed_sampler=False, :1465-1481 `_shard_multivariate_windows` keeps
final_condition[self.global_rank::world_size]): a multivariate model needs all series in every batch, so the
data-parallel axis is the window axis, split inside the step by global_rank. The dataloader batches are identical on
every rank by design; the samples each rank trains on are disjoint. Validation does the same and combines the
ranks' (sum, count) with all_gather, so the logged value is over all windows.

data-sharding and eval-duplication must see that the step itself selects rows by global_rank (a subscript at
Model._shard, reached from training_step and validation_step) and pass with a note naming that line, not fail on
"identical batches" / "indices evaluated more than once" (the sampler fix they would propose breaks the model).
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "neuralforecast 3.3.0 common/_base_model.py:1465 (_shard_multivariate_windows)"
EXPECTED = {"data-sharding": "pass", "effective-batch": "nofail", "sync-dist": "pass", "eval-duplication": "pass"}
EVIDENCE = ("passes: identical batches on every rank, but training_step/validation_step keep rows "
            "global_rank::world_size")
N_SERIES, WINDOWS, CTX = 4, 16, 6


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(8, WINDOWS, N_SERIES, CTX + 1, generator=g))  # 8 "time blocks"


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(_data(0), batch_size=1, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_data(1), batch_size=1)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.mix = torch.nn.Linear(N_SERIES * CTX, N_SERIES)
        self.val_parts = []

    def _shard(self, w):  # [W, N, CTX+1] -> this rank's windows
        return w[self.global_rank::self.trainer.world_size] if self.trainer.world_size > 1 else w

    def _loss(self, batch, reduce=True):
        w = self._shard(batch[0][0])
        pred = self.mix(w[..., :CTX].flatten(1))
        err = (pred - w[..., CTX]).abs().mean(1)
        return err.mean() if reduce else err

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        err = self._loss(batch, reduce=False)
        self.val_parts.append(torch.stack([err.sum(), torch.tensor(float(len(err)))]))

    def on_validation_epoch_end(self):
        tot = self.all_gather(torch.stack(self.val_parts).sum(0)).reshape(-1, 2).sum(0)
        self.log("val_loss", tot[0] / tot[1])  # identical on every rank after all_gather
        self.val_parts.clear()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def trainer_kwargs():
    return {"use_distributed_sampler": False, "max_epochs": 2}
