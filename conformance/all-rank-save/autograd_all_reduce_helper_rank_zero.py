"""A rank-zero summary calls torch.distributed.nn.functional.all_reduce, a collective no call in user code names.

At the end of each training epoch rank 0 alone prints the global mean of a running statistic. To average it over
the ranks it uses torch's autograd-aware helper `torch.distributed.nn.functional.all_reduce`, which all-reduces
inside torch: rank 0 waits in that all-reduce while rank 1 goes on to the next epoch's gradient all-reduce, and
the two collectives of different sizes meet (a hang or a crash, depending on timing).
Fix: make the all-reduce on every rank (it is a collective), and keep only the print under the rank guard.
"""
import lightning.pytorch as L
import torch
import torch.distributed.nn.functional as dist_fn
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "variant (issue 19: a collective that a library helper makes, under a rank guard)"
EXPECTED = {"all-rank-save": "fail", "unused-parameters": "pass", "data-sharding": "pass"}
EVIDENCE = ("the all_reduce of torch.distributed.nn.functional.all_reduce made on rank 0 only, from "
            "Model.on_train_epoch_end under `if self.global_rank == 0:`")


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x[:, :2].sum(1, keepdim=True))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.register_buffer("loss_sum", torch.zeros(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.loss_sum += loss.detach()
        return loss

    def on_train_epoch_end(self):
        if self.global_rank == 0:
            total = dist_fn.all_reduce(self.loss_sum.clone())  # a collective: every rank must make it
            print("CASE: rank 0 global loss sum", float(total), flush=True)

    def train_dataloader(self):
        return DataLoader(_rows(32, 11), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_kwargs():
    return {"max_epochs": 2}
