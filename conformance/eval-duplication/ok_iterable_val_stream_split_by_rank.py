"""CONFORMING: an iterable validation set that yields only this rank's share of the stream.

Twin of iterable_val_stream_every_rank.py: the same stream of positive triples with negatives drawn on the fly,
but each rank keeps items rank, rank + world, ..., so the ranks' validation loops receive different batches and
every positive is scored once. The logged loss is a mean synced with sync_dist=True.
"""
import os

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

SOURCE = "conforming"
PLAIN_DRIVER = "fit,validate"
EXPECTED = {"eval-duplication": "pass"}
EVIDENCE = "validation: no batch reached two ranks (compared by content: IterableDataset TripleStream)"

ENTITIES = 16


class TripleStream(IterableDataset):
    """Positive (head, relation, tail) triples, each with 4 negatives drawn on the fly."""

    def __init__(self, triples):
        self.triples = triples

    def _mine(self, items):
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return items[torch.distributed.get_rank()::torch.distributed.get_world_size()]
        return items

    def __iter__(self):
        draw = torch.Generator().manual_seed(os.getpid())  # negatives differ from rank to rank
        for triple in self._mine(self.triples):
            negatives = triple.repeat(4, 1)
            negatives[:, 2] = torch.randint(ENTITIES, (4,), generator=draw)
            yield triple, negatives


def _triples(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(ENTITIES, (n,), generator=g), torch.randint(3, (n,), generator=g),
                        torch.randint(ENTITIES, (n,), generator=g)], dim=1)


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(TensorDataset(_triples(32, 1)), batch_size=4)

    def val_dataloader(self):
        return DataLoader(TripleStream(_triples(12, 2)), batch_size=2)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.entity = torch.nn.Embedding(ENTITIES, 8)
        self.relation = torch.nn.Embedding(3, 8)

    def score(self, t):
        return -(self.entity(t[..., 0]) + self.relation(t[..., 1]) - self.entity(t[..., 2])).norm(dim=-1)

    def training_step(self, batch, batch_idx):
        (pos,) = batch
        neg = pos.clone()
        neg[:, 2] = (neg[:, 2] + 1) % ENTITIES
        return torch.nn.functional.softplus(self.score(neg) - self.score(pos)).mean()

    def validation_step(self, batch, batch_idx):
        pos, neg = batch
        loss = torch.nn.functional.softplus(self.score(neg) - self.score(pos)[:, None]).mean()
        self.log("val_loss", loss, sync_dist=True, batch_size=len(pos))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
