"""Under DeepSpeed, a callback reads the best checkpoint back with torch.load as if it were a file.

The user trains with ModelCheckpoint and, at the end of fit, exports the weights of best_model_path with
torch.load, the way it works under DDP. Under DeepSpeed, Trainer.save_checkpoint writes a directory (per-rank ZeRO
partitions, a `latest` tag, zero_to_fp32.py), and torch.load raises IsADirectoryError on every rank.
Fix: resume with Trainer(ckpt_path=dir) and the same strategy, or convert the
directory to one state dict with DeepSpeed's zero_to_fp32 utility first.
"""
import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "issue 12"
STRATEGY = "deepspeed"
EXPECTED = {"all-rank-save": "fail"}
EVIDENCE = "torch.load on a DeepSpeed checkpoint directory in `ExportWeights.on_fit_end`; `zero_to_fp32`"


class ExportWeights(L.Callback):
    def on_fit_end(self, trainer, pl_module):
        best = trainer.checkpoint_callback.best_model_path  # a directory under DeepSpeed
        state = torch.load(best, map_location="cpu", weights_only=False)
        print("CASE: rank", trainer.global_rank, "exported", len(state["state_dict"]), "tensors", flush=True)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(4)
        x = torch.randn(64, 8, generator=g)
        return DataLoader(TensorDataset(x, x[:, :2].sum(1, keepdim=True)), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def trainer_kwargs():
    return {"max_epochs": 1, "strategy": DeepSpeedStrategy(stage=2), "enable_checkpointing": True,
            "callbacks": [ModelCheckpoint(save_top_k=1), ExportWeights()]}
