"""The molecule loader of ok_collated_graphs_sharded with use_distributed_sampler=False, read by 2 workers.

The user switches Lightning's sampler off (their real project has its own sampler for validation) and keeps the
plain shuffled loader for training, with DataLoader(num_workers=2). Nothing splits the molecules between ranks:
the global RNG is seeded alike, so every rank fetches the same molecule indices in the same order, and the world
trains on one rank's data twice. The workers run __getitem__; the indices they receive are drawn in the main
process, the same whatever num_workers is. Fix: keep use_distributed_sampler=True, or give the loader a
DistributedSampler.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset

SOURCE = "variant (issue 19, section 3: collated graphs, num_workers=2)"
EXPECTED = {"data-sharding": "fail"}
EVIDENCE = "rank 0 and rank 1 fetch the same molecule indices at every step (use_distributed_sampler=False)"
TYPES = 3


class GraphBatch:
    """What torch_geometric's Batch holds, built by hand (no new dependency)."""

    def __init__(self, x, edge_index, batch, y):
        self.x, self.edge_index, self.batch, self.y = x, edge_index, batch, y


class Molecules(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.graphs = []
        for _ in range(n):
            atoms = int(torch.randint(3, 7, (1,), generator=g))
            kinds = torch.randint(0, TYPES, (atoms,), generator=g)
            ring = torch.arange(atoms)
            edges = torch.stack([ring, (ring + 1) % atoms])
            self.graphs.append((torch.nn.functional.one_hot(kinds, TYPES).float(), edges, kinds.sum().float()))

    def __len__(self):
        return len(self.graphs)

    def __getitem__(self, i):
        return self.graphs[i]


def collate(graphs):
    xs, edges, batch, offset = [], [], [], 0
    for g, (x, e, _) in enumerate(graphs):
        xs.append(x)
        edges.append(e + offset)
        batch.append(torch.full((len(x),), g))
        offset += len(x)
    return GraphBatch(torch.cat(xs), torch.cat(edges, 1), torch.cat(batch), torch.stack([y for *_, y in graphs]))


class Model(L.LightningModule):
    WORKERS = 2

    def __init__(self):
        super().__init__()
        self.atom = torch.nn.Linear(TYPES, 8)
        self.out = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        h = torch.relu(self.atom(batch.x))
        pooled = torch.zeros(len(batch.y), 8).index_add(0, batch.batch, h)
        return torch.nn.functional.mse_loss(self.out(pooled).squeeze(1), batch.y)

    def train_dataloader(self):
        return DataLoader(Molecules(64, 3), batch_size=4, shuffle=True, collate_fn=collate,
                          num_workers=self.WORKERS)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def trainer_kwargs():
    return {"use_distributed_sampler": False}
