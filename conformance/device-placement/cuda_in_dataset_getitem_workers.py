"""The dataset moves each sample to the GPU in __getitem__, and the DataLoader runs two worker processes.

`__getitem__` returns `torch.tensor(row).cuda()`, so that "the batches are already on the GPU". The workers
are forked from the rank (the default start method on Linux) after the rank made CUDA current (Lightning
moved the module there), and the first worker to touch CUDA raises "RuntimeError: Cannot re-initialize CUDA
in forked subprocess. To use CUDA with multiprocessing, you must use the 'spawn' start method". On CPU ranks
the plugin runs .cuda() on the CPU, in the workers too, and records where each worker asked for it.
Fix: return CPU tensors from the dataset; Lightning moves each batch to the rank's device.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset

SOURCE = "variant (issue 34: CUDA in a DataLoader worker forked after the rank made CUDA current)"
EXPECTED = {"device-placement": "fail"}
EVIDENCE = ("`Tensor.cuda` in the dataset's __getitem__ runs in a DataLoader worker: 'Cannot re-initialize CUDA in "
            "forked subprocess'")


class Rows(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=g).tolist()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        row = torch.tensor(self.x[i]).cuda()  # written for one GPU: "the batches are already on the GPU"
        return row, row.sum().unsqueeze(0)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.reg = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.reg(x), y)

    def train_dataloader(self):
        return DataLoader(Rows(32, 12), batch_size=4, num_workers=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
