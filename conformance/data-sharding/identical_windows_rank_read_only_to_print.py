"""VIOLATING: every rank loads the whole set and the step reads global_rank only to print on rank 0.

A variant of ok_windows_sharded_by_rank_in_step.py (the neuralforecast TSMixer pattern,
use_distributed_sampler=False, every rank given the same batches) where the user forgot the split:
training_step and validation_step read self.global_rank, but only in `if self.global_rank == 0: print(...)`.
A rank that gates a side effect selects no data, so both ranks train on the same windows in every step
and the world trains on one rank's data twice. data-sharding must still fail ("identical train batches"),
and its evidence should name the read and say it does not split the batch. Validation is evaluated whole on
every rank too (8 batches per rank, no sampler splits them): its mean loss equals the single-device value, but
every sample is evaluated twice, so eval-duplication fails, as it does for the shared case
eval-duplication/no_sampler_replacement_full_val_set_every_rank (issue 19, section 3; was "pass" with a
"wasted work" note before that rule).
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant of neuralforecast 3.3.0 common/_base_model.py:1465 (_shard_multivariate_windows) without the shard"
EXPECTED = {"data-sharding": "fail", "eval-duplication": "fail"}
EVIDENCE = ("rank 0 and rank 1 drew identical train batches in every step; training_step reads self.global_rank "
            "as the test of an if (it gates what runs, it selects no data), so it does not split the batch")
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

    def _loss(self, batch, reduce=True):
        w = batch[0][0]  # [W, N, CTX+1]: every window, on every rank
        pred = self.mix(w[..., :CTX].flatten(1))
        err = (pred - w[..., CTX]).abs().mean(1)
        return err.mean() if reduce else err

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        if self.global_rank == 0 and batch_idx == 0:
            print(f"train windows per step: {batch[0].shape[1]}")
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        err = self._loss(batch, reduce=False)
        if self.global_rank == 0 and batch_idx == 0:
            print(f"val windows per step: {len(err)}")
        self.val_parts.append(torch.stack([err.sum(), torch.tensor(float(len(err)))]))

    def on_validation_epoch_end(self):
        tot = self.all_gather(torch.stack(self.val_parts).sum(0)).reshape(-1, 2).sum(0)
        self.log("val_loss", tot[0] / tot[1])
        self.val_parts.clear()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def trainer_kwargs():
    return {"use_distributed_sampler": False, "max_epochs": 2}
