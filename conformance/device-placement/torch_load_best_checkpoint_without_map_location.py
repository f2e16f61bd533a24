"""At the end of training every rank reloads the best checkpoint with torch.load, without map_location.

on_train_end reads `self.trainer.checkpoint_callback.best_model_path` with plain
`torch.load(path, weights_only=False)` and loads its state_dict back. On GPU ranks Lightning saved that file
from rank 0's module, so its tensors carry cuda:0: without map_location every rank deserialises them onto
GPU 0, one full copy per rank on one GPU (and out of memory for a large model), before load_state_dict copies
them to the rank's own GPU. On CPU ranks the file holds CPU tensors and nothing shows.
Fix: torch.load(path, map_location=self.device) (or "cpu"), or LightningModule.load_from_checkpoint.
"""
import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant (issue 34: torch.load without map_location in a hook, of a checkpoint saved on GPU ranks)"
EXPECTED = {"device-placement": "fail", "unused-parameters": "pass"}
EVIDENCE = "torch.load in on_train_end has no map_location"


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x[:, 1:2] - x[:, 2:3])


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.reg = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.reg(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.reg(x), y), sync_dist=True)

    def on_train_end(self):
        best = self.trainer.checkpoint_callback.best_model_path
        if best:
            self.load_state_dict(torch.load(best, weights_only=False)["state_dict"])

    def train_dataloader(self):
        return DataLoader(_data(32, 15), batch_size=4)

    def val_dataloader(self):
        return DataLoader(_data(16, 16), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"max_epochs": 2, "callbacks": [ModelCheckpoint(monitor="val_loss", save_top_k=1)]}
