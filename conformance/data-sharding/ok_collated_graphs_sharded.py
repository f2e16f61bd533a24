"""CONFORMING: a molecule loader whose collate builds one graph batch (torch_geometric-like), sharded by Lightning.

Each sample is a small molecule: one-hot atom types (so many atom rows are identical), an edge index and a target.
The collate function concatenates the atoms of the batch into one `GraphBatch` (x, edge_index offset per graph, a
`batch` vector mapping atoms to molecules), as torch_geometric's `Batch.from_data_list` does. Lightning injects its
DistributedSampler, so the ranks fetch disjoint molecules. A checker that reads samples off the batch tensors counts
atoms (or edge-index rows) as samples, sees the same one-hot rows many times and calls it replayed data; the
samples are the molecule indices the dataset's __getitem__ receives.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset

SOURCE = "variant (issue 19, section 3: collated graphs)"
EXPECTED = {"data-sharding": "pass"}
EVIDENCE = "passes: each rank fetches its own molecule indices (DistributedSampler), whatever the atom rows hold"
TYPES = 3


class GraphBatch:
    """What torch_geometric's Batch holds, built by hand (no new dependency)."""

    def __init__(self, x, edge_index, batch, y):
        self.x, self.edge_index, self.batch, self.y = x, edge_index, batch, y

    def to(self, device):  # as torch_geometric's Batch: Lightning moves the batch with it
        return GraphBatch(self.x.to(device), self.edge_index.to(device), self.batch.to(device), self.y.to(device))


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
    WORKERS = 0

    def __init__(self):
        super().__init__()
        self.atom = torch.nn.Linear(TYPES, 8)
        self.out = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        h = torch.relu(self.atom(batch.x))
        pooled = torch.zeros(len(batch.y), 8, device=h.device).index_add(0, batch.batch, h)
        return torch.nn.functional.mse_loss(self.out(pooled).squeeze(1), batch.y)

    def train_dataloader(self):
        return DataLoader(Molecules(64, 3), batch_size=4, shuffle=True, collate_fn=collate,
                          num_workers=self.WORKERS)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
