"""A per-rank count made with torch.tensor(n), no device, is gathered with trainer.strategy.all_gather at epoch end.

The user counts the validation samples each rank saw and gathers the counts to check the split:
`self.trainer.strategy.all_gather(torch.tensor(self._seen))`. The strategy's all_gather hands the tensor to
torch.distributed as it is, on the CPU, while the module is on the rank's GPU (LightningModule.all_gather
would have moved it to self.device first: Lightning 2.6.6's convert_to_tensors). Gloo gathers CPU tensors, so
this CPU run is clean; under NCCL, the only backend of Lightning's process group on GPUs, the gather raises
"No backend type associated with device type cpu".
Fix: torch.tensor(self._seen, device=self.device), or self.all_gather(...).
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant (issue 34: a tensor made without a device, given to the strategy's all_gather)"
EXPECTED = {"device-placement": "fail", "unused-parameters": "pass"}
EVIDENCE = "torch.tensor without a device in on_validation_epoch_end reaches `all_gather` on the CPU"


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.reg = torch.nn.Linear(4, 1)
        self._seen = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.reg(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self._seen += len(x)
        self.log("val_loss", torch.nn.functional.mse_loss(self.reg(x), y), sync_dist=True)

    def on_validation_epoch_end(self):
        counts = self.trainer.strategy.all_gather(torch.tensor(self._seen))  # no device: a CPU tensor
        self._seen = 0
        self.log("val_samples", counts.sum().float(), rank_zero_only=True)

    def train_dataloader(self):
        return DataLoader(_data(32, 1), batch_size=4)

    def val_dataloader(self):
        return DataLoader(_data(16, 2), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
