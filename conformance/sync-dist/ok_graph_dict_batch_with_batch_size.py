"""Conforming: an epoch-mean loss on dict batches of collated graphs, logged with the number of graphs.

The same graph batches as epoch_mean_graph_dict_batch_no_batch_size.py (batch["x"] holds [num_nodes, 4] node
features first), but validation_step passes batch_size=len(batch["y"]), the number of graphs: Lightning's epoch
mean weights every batch by its samples. A checker must pass sync-dist here.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset

SOURCE = "seed"
EXPECTED = {"sync-dist": "pass", "unused-parameters": "pass"}
EVIDENCE = "passes: val_loss is logged with batch_size=len(batch['y'])"



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
        pooled = torch.zeros(len(batch["y"]), 8, device=h.device).index_add(0, batch["graph"], h)
        counts = torch.bincount(batch["graph"], minlength=len(batch["y"])).clamp(min=1).unsqueeze(1)
        logits = self.head(pooled / counts).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch["y"])

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, batch_size=len(batch["y"]))
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True, batch_size=len(batch["y"]))

    def train_dataloader(self):
        return DataLoader(Graphs(64, 3), batch_size=4, collate_fn=collate, shuffle=True)

    def val_dataloader(self):
        return DataLoader(Graphs(48, 4), batch_size=4, collate_fn=collate)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def trainer_kwargs():
    return dict(max_epochs=2, num_sanity_val_steps=0, enable_checkpointing=False)
