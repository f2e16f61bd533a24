"""A two-node SLURM job that raises the collective timeout with `export NCCL_TIMEOUT=7200` in the sbatch
script and leaves the Trainer's strategy as the plain string "ddp".

The layout itself is right (2 nodes x 1 task, SLURM_NTASKS 2 = 2 x 1). But torch.distributed takes the
process-group timeout from the strategy (DDPStrategy(timeout=...), default 30 minutes); NCCL_TIMEOUT is not a
supported way to set it, so a long checkpoint write on rank 0 still times the other ranks out at the default.
Fix: DDPStrategy(timeout=timedelta(hours=2)) and drop the variable.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"launch-env": "fail", "sync-dist": "pass"}
EVIDENCE = "NCCL_TIMEOUT=7200 is set on rank(s) 0, 1 while the strategy keeps its default process-group timeout"

_COMMON = {"SLURM_JOB_ID": "51234", "SLURM_JOB_NAME": "pretrain", "SLURM_NNODES": "2", "SLURM_NTASKS": "2",
           "SLURM_NTASKS_PER_NODE": "1", "SLURM_NODELIST": "gpu[07-08]", "SLURM_LOCALID": "0",
           "NCCL_TIMEOUT": "7200"}
LAUNCH_ENV = {  # node rank -> the environment of the one task SLURM started there
    0: {**_COMMON, "SLURM_NODEID": "0", "SLURM_PROCID": "0"},
    1: {**_COMMON, "SLURM_NODEID": "1", "SLURM_PROCID": "1"},
}


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.lin(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(y))
        return loss

    def train_dataloader(self):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(24, 3, generator=g)
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"num_nodes": 2, "devices": 1, "strategy": "ddp"}
