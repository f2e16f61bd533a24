"""Padded sequences in a dataclass batch; the loss divides the summed token error by the local token count.

Even-indexed sequences have 12 steps, odd-indexed ones 2 steps with large targets, and Lightning's
DistributedSampler (no shuffle) deals evens to rank 0 and odds to rank 1: DDP averages two per-rank token means,
so a token on rank 1 weighs 6 times more than one on rank 0. The 1-rank batch has to be built through the
collate_fn (the two ranks pad to different lengths).
"""
from dataclasses import dataclass

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset

SOURCE = "variant"
EXPECTED = {"effective-batch": "fail"}
EVIDENCE = "factor that is not the world size; divides by a local count (valid.sum())"


@dataclass
class Padded:
    tokens: torch.Tensor
    valid: torch.Tensor
    target: torch.Tensor


class Seqs(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(9)
        self.items = []
        for i in range(16):
            t = 12 if i % 2 == 0 else 2
            x = torch.randn(t, 3, generator=g)
            self.items.append((x, float(x.sum()) * (1.0 if i % 2 == 0 else 8.0)))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def pad(items):
    t_max = max(len(x) for x, _ in items)
    tokens = torch.zeros(len(items), t_max, 3)
    valid = torch.zeros(len(items), t_max)
    for k, (x, _) in enumerate(items):
        tokens[k, : len(x)] = x
        valid[k, : len(x)] = 1.0
    return Padded(tokens, valid, torch.tensor([y for _, y in items]))


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(Seqs(), batch_size=4, collate_fn=pad)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        err = (self.proj(batch.tokens).squeeze(-1) - batch.target.unsqueeze(1)) ** 2
        return (err * batch.valid).sum() / batch.valid.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
