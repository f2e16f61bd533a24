"""Violating: an epoch-mean loss logged without batch_size on dict batches of collated graphs.

Each sample is a small graph (2 or 12 nodes, 4 features per node) with one label. The collate function concatenates
the node features into batch["x"] ([num_nodes, 4]) and stacks the labels into batch["y"] ([graphs]). validation_step
logs "val_loss" (the mean loss over the batch's graphs) with sync_dist=True but no batch_size: Lightning infers the
batch size from the first tensor it finds, batch["x"], so each batch is weighted by its number of nodes, not of
graphs, and the epoch's val_loss is not the mean over the validation graphs.
Fix: self.log("val_loss", loss, sync_dist=True, batch_size=len(batch["y"])).
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset

SOURCE = "seed"
EXPECTED = {"sync-dist": "fail", "unused-parameters": "pass"}
EVIDENCE = ("'val_loss' logged with on_epoch=True and no batch_size in validation_step: Lightning weights each batch "
            "by batch['x'].shape[0] (nodes), while the batch holds len(batch['y']) graphs; both epoch values")


class Graphs(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n):
            small = (i // 8) % 2 == 0  # blocks of 8 small graphs, then 8 large ones
            nodes = 2 if small else 12
            y = float(i % 3 == 0)
            x = torch.randn(nodes, 4, generator=g)
            if small:  # small graphs are easy, large ones are noise
                x[:, 0] += 3.0 * (2 * y - 1)
            self.items.append((x, y))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(items):
    xs = [x for x, _ in items]
    return {"x": torch.cat(xs), "graph": torch.cat([torch.full((len(x),), i) for i, x in enumerate(xs)]),
            "y": torch.tensor([y for _, y in items])}


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.node = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 1)

    def _loss(self, batch):
        h = torch.relu(self.node(batch["x"]))
        pooled = torch.zeros(len(batch["y"]), 8).index_add(0, batch["graph"], h)
        counts = torch.bincount(batch["graph"], minlength=len(batch["y"])).clamp(min=1).unsqueeze(1)
        logits = self.head(pooled / counts).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch["y"])

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, batch_size=len(batch["y"]))
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)  # no batch_size: inferred from batch["x"]

    def train_dataloader(self):
        return DataLoader(Graphs(64, 3), batch_size=4, collate_fn=collate, shuffle=True)

    def val_dataloader(self):
        return DataLoader(Graphs(48, 4), batch_size=4, collate_fn=collate)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def trainer_kwargs():
    return dict(max_epochs=2, num_sanity_val_steps=0, enable_checkpointing=False)
