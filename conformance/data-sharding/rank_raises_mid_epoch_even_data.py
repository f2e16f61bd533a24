"""Even data, but rank 1 raises in training_step in the middle of epoch 1: not a data-sharding fault.

Lightning's DistributedSampler gives both ranks 4 batches per epoch. Rank 1 raises a ValueError at its second
batch of epoch 1 (a bad value in its own code path), so rank 0 runs on into a collective its peer never joins and the
world stops. The recorded batch counts of epoch 1 differ (rank 1 stopped early), yet the DataLoaders have the same
length on both ranks: a checker must blame the raising rank's own line, never data-sharding.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "issue 11"
EXPECTED = {"data-sharding": "nofail"}
EVIDENCE = "rank 1 raised ValueError in training_step at epoch 1, batch 1; both train DataLoaders have 4 batches"


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_rank == 1 and self.current_epoch == 1 and batch_idx == 1:
            raise ValueError("negative scale in rank-local augmentation")
        return torch.nn.functional.mse_loss(self.lin(x), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(5)
        x = torch.randn(32, 3, generator=g)
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
