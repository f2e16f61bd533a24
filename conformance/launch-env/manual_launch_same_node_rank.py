"""A hand-managed two-node launch: the same script is started on both hosts with the same exported
environment, `MASTER_ADDR=hostA MASTER_PORT=29500 NODE_RANK=0`, and a Trainer with num_nodes=2, devices=1.

Both processes claim node 0, so Lightning's LightningEnvironment gives both global rank 0 and the rendezvous
never completes (two rank-0 processes, nobody as rank 1). NODE_RANK must differ per node (0 on hostA, 1 on
hostB); parsing a --node_rank argument without exporting it has no effect.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"launch-env": "fail"}
EVIDENCE = "the Trainer has num_nodes=2 but the processes report 1 distinct NODE_RANK value(s) (0)"

_SHARED = {"MASTER_ADDR": "hostA", "MASTER_PORT": "29500", "NODE_RANK": "0", "WORLD_SIZE": "2",
           "LOCAL_RANK": "0"}
LAUNCH_ENV = {0: [dict(_SHARED), dict(_SHARED)]}  # both hosts say they are node 0


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.lin(x), y)

    def train_dataloader(self):
        x = torch.randn(16, 2, generator=torch.Generator().manual_seed(5))
        return DataLoader(TensorDataset(x, x[:, :1]), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"num_nodes": 2, "devices": 1}
