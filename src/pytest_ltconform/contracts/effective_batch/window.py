"""Rank-side helpers of effective-batch: the samples of the first window and how the one-rank
reference rebuilds them, the scale a manual loss carries, and where a step draws random numbers.
Imported only in ranks (torch is imported inside the functions)."""

from __future__ import annotations

import contextlib
import random

from ...harness import batch_leaves
from ...sites import user_site

MAX_RECORDED = 64  # index batches kept per rank: the first window is all that is compared


def to_cpu(batch):
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.detach().cpu().clone()
    if isinstance(batch, dict):
        return {k: to_cpu(v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*[to_cpu(v) for v in batch])
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_cpu(v) for v in batch)
    return batch


def concatenable(items: list) -> str | None:
    """None when ``items`` (one batch per rank) are plain tensors, tuples, lists or dicts of
    tensors whose trailing shapes agree, so that field-wise concatenation along dim 0 is the
    batch one rank would have built; else what stands in the way, in a few words."""
    import torch

    first = items[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return "a batch field is a scalar tensor (per-batch value)"
        if any(not isinstance(it, torch.Tensor) or it.shape[1:] != first.shape[1:] for it in items):
            return "tensors of different trailing shapes (padded to each batch's own length)"
        return None
    if isinstance(first, dict):
        if any(not isinstance(it, dict) or it.keys() != first.keys() for it in items):
            return "dict batches with different keys"
        return next((why for k in first if (why := concatenable([it[k] for it in items]))), None)
    if isinstance(first, (list, tuple)):
        if any(type(it) is not type(first) or len(it) != len(first) for it in items):
            return "sequence batches of different lengths"
        return next((why for parts in zip(*items) if (why := concatenable(list(parts)))), None)
    return f"a batch of type {type(first).__name__} (not tensors, tuples or dicts of tensors)"


def concat(items: list):
    """One batch from the ranks' batches: tensors concatenated along dim 0, containers per field."""
    import torch

    first = items[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(items) if first.dim() > 0 else torch.stack(items)
    if isinstance(first, dict):
        return {k: concat([it[k] for it in items]) for k in first}
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*[concat(list(parts)) for parts in zip(*items)])
    if isinstance(first, tuple):
        return tuple(concat(list(parts)) for parts in zip(*items))
    if isinstance(first, list):
        if all(isinstance(x, (str, int, float)) for it in items for x in it):
            return [x for it in items for x in it]
        return [concat(list(parts)) for parts in zip(*items)]
    return first


def tensors(obj) -> list:
    """The tensors of a batch in a fixed order, also inside dataclasses and plain objects."""
    import torch

    leaves: list = []
    batch_leaves(obj, leaves)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def same_batches(a: list, b: list) -> bool:
    import torch

    ta, tb = tensors(a), tensors(b)
    return len(ta) == len(tb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(ta, tb))


class IndexRecorder:
    """Stands in for a DataLoader's batch_sampler and keeps the index lists it yields (in the main
    process, whatever the workers), so that the reference can fetch the same samples."""

    def __init__(self, inner):
        self.inner = inner
        self.lists: list = []

    def __iter__(self):
        for idx in self.inner:
            if len(self.lists) < MAX_RECORDED:
                self.lists.append(list(idx))
            yield idx

    def __len__(self):
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def record_indices(loader) -> IndexRecorder | None:
    """Install an :class:`IndexRecorder` on a map-style, auto-batched DataLoader; None otherwise."""
    from torch.utils.data import DataLoader, IterableDataset

    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return None
    if loader.batch_sampler is None:
        return None
    recorder = IndexRecorder(loader.batch_sampler)
    object.__setattr__(loader, "batch_sampler", recorder)  # DataLoader forbids it after init
    return recorder


def seed_all(seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed(seed)


def merged_by_loader(loader, per_rank: list, micro: int) -> tuple[list | None, str | None]:
    """The one-rank micro-batches of the first window: for each micro-batch ``j``, the indices of
    rank 0, rank 1, ... in that order, fetched from the user's dataset through their collate_fn.
    Returns ``(batches, None)`` or ``(None, reason)``; the samples are fetched twice under two
    seeds, so a dataset that draws random numbers while loading is a reason."""
    from torch.utils.data import DataLoader

    lists = [[i for rank in per_rank for i in rank[j]] for j in range(micro)]

    def fetch(seed: int) -> list:
        seed_all(seed)
        dl = DataLoader(loader.dataset, batch_sampler=lists, collate_fn=loader.collate_fn, num_workers=0)
        return [to_cpu(b) for b in dl]

    try:
        first, second = fetch(1), fetch(2)
    except Exception as exc:  # the user's dataset or collate_fn on a batch of world x local samples
        return None, f"the user's collate_fn could not build one batch of the ranks' samples ({exc!r:.120})"
    if not same_batches(first, second):
        return None, "the dataset returns different samples for the same indices (random draws while loading)"
    return first, None


def root_scale(loss) -> float | None:
    """The product of the constant scalar factors at the root of ``loss``'s autograd graph
    (``loss / N`` gives 1/N, ``0.5 * loss`` 0.5, a bare mean 1.0); None for a loss without graph."""
    try:
        return _root_scale(loss)
    except Exception:  # an unusual graph: no factor known, the window is then not judged
        return None


def _root_scale(loss) -> float | None:
    fn = getattr(loss, "grad_fn", None)
    if fn is None:
        return None
    scale = 1.0
    while type(fn).__name__ in ("MulBackward0", "DivBackward0"):
        nxt = fn.next_functions
        if len(nxt) != 2 or (nxt[0][0] is None) == (nxt[1][0] is None):
            break
        div = type(fn).__name__ == "DivBackward0"
        if div and nxt[0][0] is None:
            break  # constant / loss: not a scale
        const = getattr(fn, "_saved_other" if nxt[1][0] is None else "_saved_self", None)
        if const is None or getattr(const, "numel", lambda: 2)() != 1:
            break
        value = float(const)
        if value == 0.0:
            break
        scale = scale / value if div else scale * value
        fn = nxt[0][0] if nxt[1][0] is None else nxt[1][0]
    return scale


_TORCH_DRAWS = ("randint", "rand", "randn", "randperm", "rand_like", "randn_like", "randint_like", "normal",
                "bernoulli", "multinomial", "poisson")
_TENSOR_DRAWS = ("normal_", "uniform_", "bernoulli_", "random_", "exponential_")
_F_DRAWS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")


@contextlib.contextmanager
def watch_draws(found: list, active=lambda: True):
    """While active, the first user call site of each torch/random draw made while ``active()``
    is true (the reference's training steps, not the epoch's other hooks) is appended to ``found``
    as ``{"file", "line", "func", "what"}`` (functional dropout only when training)."""
    import torch
    import torch.nn.functional as F

    targets = [(torch, n, f"torch.{n}") for n in _TORCH_DRAWS] + \
        [(torch.Tensor, n, f"Tensor.{n}") for n in _TENSOR_DRAWS] + \
        [(F, n, f"F.{n}") for n in _F_DRAWS] + \
        [(random, n, f"random.{n}") for n in ("random", "randint", "randrange", "choice", "sample", "shuffle",
                                               "uniform", "gauss")]
    saved = []
    for owner, name, label in targets:
        original = getattr(owner, name, None)
        if original is None:
            continue
        saved.append((owner, name, original, name in vars(owner)))
        setattr(owner, name, _draw_tap(original, label, found, name in _F_DRAWS, active))
    try:
        yield found
    finally:
        for owner, name, original, own in saved:
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # inherited (Tensor methods live on TensorBase)


def _draw_tap(original, label: str, found: list, dropout: bool, active):
    def tap(*args, **kwargs):
        training = kwargs.get("training", args[2] if len(args) > 2 else True)
        drawn = not dropout or (training and kwargs.get("p", args[1] if len(args) > 1 else 0.5))
        if drawn and len(found) < 8 and active():
            site, _ = user_site(1)
            if site is not None and all((s["file"], s["line"]) != (site["file"], site["line"]) for s in found):
                found.append({**site, "what": label})
        return original(*args, **kwargs)

    return tap
