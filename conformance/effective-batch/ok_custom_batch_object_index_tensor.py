"""CONFORMING: a collate_fn returns a plain object holding padded tokens, a per-batch index tensor and lengths.

The object is not a tensor, tuple, dict or dataclass, the padding length differs per batch, and ``segment`` maps
each token row to its sample inside the batch (0..B-1), so field-wise concatenation would be wrong. The loss is
a mean over samples of each sample's mean over its own valid steps: world-size invariant.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset

SOURCE = "variant"
EXPECTED = {"effective-batch": "pass"}
EVIDENCE = "passes: the 1-rank batch is built through the user's collate_fn"


class Packed:
    def __init__(self, values, segment, n):
        self.values = values    # [total_steps, 3]: every sample's steps, packed
        self.segment = segment  # [total_steps]: which sample of this batch a step belongs to
        self.n = n

    def to(self, device):
        return Packed(self.values.to(device), self.segment.to(device), self.n)


class Seqs(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(5)
        self.items = [(torch.randn(int(t), 3, generator=g), float(i % 3)) for i, t in
                      enumerate(torch.randint(2, 9, (32,), generator=g))]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def pack(items):
    values = torch.cat([s for s, _ in items])
    segment = torch.cat([torch.full((len(s),), k) for k, (s, _) in enumerate(items)])
    return Packed(values, segment, len(items)), torch.tensor([t for _, t in items])


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(Seqs(), batch_size=4, collate_fn=pack)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        packed, target = batch
        return packed.to(device), target.to(device)

    def training_step(self, batch, batch_idx):
        packed, target = batch
        err = (self.lin(packed.values).squeeze(-1) - target[packed.segment]) ** 2
        per_sample = torch.zeros(packed.n, device=err.device).index_add(0, packed.segment, err)
        steps = torch.zeros(packed.n, device=err.device).index_add(0, packed.segment, torch.ones_like(err))
        return (per_sample / steps).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
