"""ZeRO-Infinity offload to NVMe points at a folder that does not exist on the machine.

The user copies the seed's stage-3 NVMe offload recipe with typed DeepSpeedStrategy arguments but keeps the
example nvme_path. DeepSpeed only opens the swap folder once the engine is built on the GPUs, after the job was
queued and every rank started, and then fails on every node. Fix: an explicit, writable local NVMe path that
exists on every node (or offload to cpu).
"""
import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "seed"
EXPECTED = {"strategy-config": "fail"}
EVIDENCE = ("DeepSpeed offload_optimizer offloads to NVMe at '/mnt/nvme-missing/ltconform-case', which does not "
            "exist")

NVME = "/mnt/nvme-missing/ltconform-case"


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(43)
        x = torch.randn(32, 6, generator=g)
        return DataLoader(TensorDataset(x, x.mean(dim=1, keepdim=True)), batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.lin(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def trainer_kwargs():
    return {"strategy": DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True,
                                          remote_device="nvme", offload_params_device="nvme",
                                          offload_optimizer_device="nvme", nvme_path=NVME)}
