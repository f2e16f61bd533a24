"""CONFORMING: a stream of molecules (IterableDataset) read by 2 workers, sharded by rank and worker, collated into
graph batches.

The stream keeps molecule i only on its share (rank * workers + worker of world * workers), so every rank and worker
yields its own molecules. The collate function concatenates atoms into one GraphBatch (torch_geometric-like, built
by hand). The items the iterator yields are the samples; the batch's atom rows (one-hot types, many alike) are not,
and a checker that reads them as samples calls the stream replayed.
"""
import lightning.pytorch as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

SOURCE = "variant (issue 19, section 3: iterable datasets, collated graphs, num_workers=2)"
EXPECTED = {"data-sharding": "pass"}
EVIDENCE = "passes: each rank's workers yield disjoint molecules (i % 4 == rank * 2 + worker)"
TYPES = 3
SHARD = True


class GraphBatch:
    """What torch_geometric's Batch holds, built by hand (no new dependency)."""

    def __init__(self, x, edge_index, batch, y):
        self.x, self.edge_index, self.batch, self.y = x, edge_index, batch, y

    def to(self, device):  # as torch_geometric's Batch: Lightning moves the batch with it
        return GraphBatch(self.x.to(device), self.edge_index.to(device), self.batch.to(device), self.y.to(device))


class MoleculeStream(IterableDataset):
    """A stream of molecules; SHARD: keep molecule i only on its rank and worker."""

    SHARD = True

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.graphs = []
        for _ in range(n):
            atoms = int(torch.randint(3, 7, (1,), generator=g))
            kinds = torch.randint(0, TYPES, (atoms,), generator=g)
            ring = torch.arange(atoms)
            edges = torch.stack([ring, (ring + 1) % atoms])
            self.graphs.append((torch.nn.functional.one_hot(kinds, TYPES).float(), edges, kinds.sum().float()))

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        share, of = rank * workers + worker, world * workers
        for i, graph in enumerate(self.graphs):
            if not self.SHARD or i % of == share:
                yield graph


def collate(graphs):
    xs, edges, batch, offset = [], [], [], 0
    for g, (x, e, _) in enumerate(graphs):
        xs.append(x)
        edges.append(e + offset)
        batch.append(torch.full((len(x),), g))
        offset += len(x)
    return GraphBatch(torch.cat(xs), torch.cat(edges, 1), torch.cat(batch), torch.stack([y for *_, y in graphs]))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.atom = torch.nn.Linear(TYPES, 8)
        self.out = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        h = torch.relu(self.atom(batch.x))
        pooled = torch.zeros(len(batch.y), 8, device=h.device).index_add(0, batch.batch, h)
        return torch.nn.functional.mse_loss(self.out(pooled).squeeze(1), batch.y)

    def train_dataloader(self):
        stream = MoleculeStream(64, 3)
        stream.SHARD = SHARD
        return DataLoader(stream, batch_size=4, collate_fn=collate, num_workers=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
