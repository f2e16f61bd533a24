"""The CUDA index is taken from the global rank: right on one node, past the GPUs of the second.

Written for one machine, the module sets its GPU in setup with `torch.cuda.set_device(dist.get_rank())` and
builds a step's noise on `f"cuda:{self.global_rank}"`. The Trainer config asks for two nodes. On one node the
global rank is the local rank, so this CPU run (and a one-node GPU run) is fine; on the second node rank 4 of
2 x 4 GPUs asks for cuda:4 and raises "CUDA error: invalid device ordinal" (meta-llama/llama-cookbook#90:
set_device(rank) instead of local_rank breaks multi-node fine-tuning).
Fix: the local rank (self.local_rank, int(os.environ["LOCAL_RANK"])) or self.device.
"""
import lightning.pytorch as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "https://github.com/meta-llama/llama-cookbook/issues/90"
EXPECTED = {"device-placement": "fail", "unused-parameters": "pass"}
EVIDENCE = ("torch.cuda.set_device and torch.randn take the CUDA index from the global rank: 'invalid device ordinal' "
            "on the second node")


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.mean(1, keepdim=True))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.reg = torch.nn.Linear(4, 1)

    def setup(self, stage):
        torch.cuda.set_device(dist.get_rank())

    def training_step(self, batch, batch_idx):
        x, y = batch
        noise = 0.01 * torch.randn(x.shape, device=f"cuda:{self.global_rank}")
        return torch.nn.functional.mse_loss(self.reg(x + noise), y)

    def train_dataloader(self):
        return DataLoader(_data(32, 5), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"accelerator": "gpu", "devices": 4, "num_nodes": 2, "max_epochs": 1}
