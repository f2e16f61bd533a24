"""ModelCheckpoint writes to a directory under tempfile.gettempdir(): the checkpoint lives on node 0's disk only.

The user keeps checkpoints in `<gettempdir>/ckpts` ("scratch is fast") and, when fit ends, a small callback
reloads the best checkpoint on every rank to continue with the best weights (what trainer.test(ckpt_path="best"),
the LR finder's restore and a resumed run all do). Under DDP only global rank 0 writes checkpoint files, and
ModelCheckpoint broadcasts rank 0's directory, so every rank asks for the same path; on one node that path exists
for everybody. On two nodes it exists on node 0 only: the load on node 1 raises FileNotFoundError (Lightning's
own LR finder hit this: "the checkpoint file is only saved on the 0-th node and is not present on other nodes").
Fix: put dirpath on storage all nodes mount (default_root_dir on a shared filesystem), or copy it to each node.
"""
import os
import tempfile

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "https://github.com/Lightning-AI/pytorch-lightning/issues/18812"
EXPECTED = {"node-local-files": "fail", "all-rank-save": "pass", "sync-dist": "pass"}
EVIDENCE = ("ModelCheckpoint(dirpath=<gettempdir>/ckpts) saved epoch=*.ckpt from global rank 0 onto node 0's "
            "local storage; RestoreBest.on_fit_end on global rank 1 (node 1) opened best_model_path: "
            "FileNotFoundError. The checkpoint dir must be shared")
# The fault shows only on a world of several nodes: the corpus's cheaper matrix judges it there too.
NODES = 2


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > x[:, 1]).long())


class RestoreBest(L.Callback):
    def on_fit_end(self, trainer, pl_module):
        best = trainer.checkpoint_callback.best_model_path
        print("CASE: rank", trainer.global_rank, "node", trainer.node_rank, "loads", best, "exists:",
              os.path.exists(best), flush=True)
        state = torch.load(best, map_location="cpu", weights_only=False)["state_dict"]
        pl_module.load_state_dict(state)


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(_data(32, 61), batch_size=4, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_data(16, 62), batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True, batch_size=len(y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def trainer_kwargs():
    ckpt_dir = os.path.join(tempfile.gettempdir(), "ckpts")
    return {"enable_checkpointing": True,
            "callbacks": [ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", save_top_k=1), RestoreBest()]}
