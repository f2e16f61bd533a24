"""How many samples a batch holds, next to what Lightning's batch-size inference reads from it
(rank side; imported only inside rank processes).

Without ``self.log(..., batch_size=...)``, Lightning weights an epoch mean by the first dimension
of the first tensor it finds in the batch (``extract_batch_size``: tensors, then mappings' values,
iterables and dataclass fields in order). That is the number of samples only when the first
tensor has one row per sample: a dict whose first value is a ``[num_nodes, F]`` graph tensor, or
a collated graph object, gives the number of nodes instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

_MAX_LEAVES = 64


def tensor_leaves(batch, path: tuple = (), out: list | None = None) -> list[tuple[tuple, tuple]]:
    """``[(path, shape)]`` of the tensors in ``batch``, in the order Lightning's
    ``extract_batch_size`` visits them (at most 64)."""
    import torch

    out = [] if out is None else out
    if len(out) >= _MAX_LEAVES:
        return out
    if isinstance(batch, torch.Tensor):
        out.append((path, tuple(batch.shape)))
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            tensor_leaves(value, path + (key,), out)
    elif isinstance(batch, Iterable) and not isinstance(batch, (str, bytes)):
        for i, value in enumerate(batch):
            tensor_leaves(value, path + (i,), out)
            if len(out) >= _MAX_LEAVES:
                break
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for field in dataclasses.fields(batch):
            tensor_leaves(getattr(batch, field.name), path + (field.name,), out)
    return out


def fmt_path(path: tuple) -> str:
    """``batch['x']``, ``batch[0]``: where a tensor sits in the batch."""
    return "batch" + "".join(f"[{p!r}]" for p in path)


def _rows(shape: tuple) -> int:
    return int(shape[0]) if shape else 1


def count_samples(batch, loader_bs: int | None, learned: dict, where: tuple) -> dict | None:
    """``{"inferred", "samples", "first", "sample_path"}`` for a batch whose sample count is known
    (a collated graph's ``num_graphs``, or the tensor that held ``loader_bs`` rows on a full batch,
    remembered in ``learned[where]``); None when the count is unknown."""
    num_graphs = getattr(batch, "num_graphs", None)
    if isinstance(batch, (Mapping, list, tuple)) or not isinstance(num_graphs, int):
        num_graphs = None
    try:
        leaves = tensor_leaves(batch)
    except Exception:
        return None
    if not leaves:
        return None
    first_path, first_shape = leaves[0]
    inferred = _rows(first_shape)
    if num_graphs is not None:
        return {"inferred": inferred, "samples": num_graphs, "first": [fmt_path(first_path), list(first_shape)],
                "sample_path": "batch.num_graphs"}
    if learned.get(where) is None and loader_bs:
        found = next((p for p, shape in leaves if _rows(shape) == loader_bs), None)
        if found is not None:
            learned[where] = found
    path = learned.get(where)
    shapes = dict(leaves)
    if path is None or path not in shapes:
        return None
    return {"inferred": inferred, "samples": _rows(shapes[path]), "first": [fmt_path(first_path), list(first_shape)],
            "sample_path": fmt_path(path)}


def loader_batch_size(trainer, stage: str, idx: int) -> int | None:
    """The ``batch_size`` of the DataLoader a batch of ``stage`` came from; None when unknown."""
    try:
        loaders = {"train": lambda: trainer.train_dataloader, "val": lambda: trainer.val_dataloaders,
                   "test": lambda: trainer.test_dataloaders}[stage]()
    except Exception:
        return None
    if isinstance(loaders, (list, tuple)):
        loaders = loaders[idx] if idx < len(loaders) else None
    size = getattr(loaders, "batch_size", None)
    if size is None:
        size = getattr(getattr(loaders, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None
