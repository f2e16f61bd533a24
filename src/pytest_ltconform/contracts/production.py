"""What every rank of the production world would read in an epoch, without its processes.

The Trainer config says how many ranks the job will have (``num_nodes`` x ``devices``, say 8 x 8);
a sharding fault may show only there (a padding that repeats a third of a small validation set, a
``drop_last`` that leaves a class out). For a DataLoader whose sampler is torch's
``DistributedSampler`` (the one Lightning injects, or the user's own, or Lightning's wrapper of
the user's sampler) the indices of rank ``r`` of ``N`` are computed here from that sampler with
its own dataset, shuffle, seed and drop_last, rank and world size set, as the sampler itself
computes them; batches follow from the loader's batch size and ``drop_last``. A loader whose ranks
split the data another way (an IterableDataset, a sampler of the user's own making) is not
computed, and the result says so.

Shared by data-sharding (training) and eval-duplication (evaluation). Rank side:
:func:`plan`; pytest side: :func:`sentences`. Imports torch only inside :func:`plan`.
"""

from __future__ import annotations

import copy
import math

# Label counts are read from these dataset attributes, or a TensorDataset's last tensor.
LABEL_ATTRS = ("targets", "labels", "y")
MAX_SAMPLES = 2_000_000  # samples x ranks enumerated at most: a larger plan is not computed


def production_world(user: dict) -> tuple[int, int] | None:
    """(num_nodes, devices) the Trainer kwargs ``user`` give as numbers; None when devices is not
    a number (``'auto'``, unset)."""
    def count(value, default=None):
        if isinstance(value, bool):
            return None
        if isinstance(value, int):
            return value if value > 0 else None
        if isinstance(value, (list, tuple)):
            return len(value) or None
        if isinstance(value, str) and value.strip().isdigit():
            return int(value.strip()) or None
        return default

    devices = count(user.get("devices"))
    nodes = count(user.get("num_nodes", 1), 1)
    return (nodes, devices) if devices and nodes else None


def _distributed_sampler(loader):
    from torch.utils.data import DistributedSampler

    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, DistributedSampler):
        return sampler
    inner = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    return inner if isinstance(inner, DistributedSampler) else None


def _indices_of(sampler, world: int, rank: int, epoch: int) -> list[int]:
    """The indices rank ``rank`` of ``world`` gets from a copy of ``sampler`` (torch's formula)."""
    s = copy.copy(sampler)
    s.num_replicas, s.rank = world, rank
    n = len(s.dataset)
    if s.drop_last and n % world:
        s.num_samples = math.ceil((n - world) / world)
    else:
        s.num_samples = math.ceil(n / world)
    s.total_size = s.num_samples * world
    s.set_epoch(epoch)
    return [int(i) for i in iter(s)]


def _labels(dataset) -> list | None:
    """One label per sample when the dataset holds them as a sequence (``targets``, ``labels``, a
    TensorDataset's last 1-D integer tensor); None otherwise."""
    import torch

    for attr in LABEL_ATTRS:
        values = getattr(dataset, attr, None)
        if isinstance(values, torch.Tensor) and values.dim() == 1:
            return values.tolist()
        if isinstance(values, (list, tuple)) and values and isinstance(values[0], int):
            return list(values)
    tensors = getattr(dataset, "tensors", None)
    if tensors and isinstance(tensors[-1], torch.Tensor) and tensors[-1].dim() == 1 and \
            not tensors[-1].is_floating_point():
        return tensors[-1].tolist()
    return None


def plan(loader, user: dict, run_world: int, epoch: int = 0) -> dict | None:
    """What each rank of the production world reads of ``loader`` in epoch ``epoch`` (plain data),
    or None when the config names no production size larger than the run's ``run_world``."""
    shape = production_world(user)
    if shape is None or shape[0] * shape[1] <= run_world:
        return None
    world = shape[0] * shape[1]
    out = {"world": world, "nodes": shape[0], "devices": shape[1]}
    sampler = _distributed_sampler(loader)
    if sampler is None:
        kind = type(getattr(loader, "dataset", None)).__name__
        out["not_computed"] = (f"the loader's ranks do not split the data with a DistributedSampler ({kind}, sampler "
                               f"{type(getattr(loader, 'sampler', None)).__name__}): only a sampler can be replayed "
                               f"for another world size")
        return out
    samples = len(sampler.dataset)
    if samples * world > MAX_SAMPLES:
        out["not_computed"] = f"{samples} samples x {world} ranks is more than this check enumerates"
        return out
    wrapped = getattr(sampler.dataset, "reset", None)
    if callable(wrapped):  # Lightning's wrapper of the user's sampler: draw its order once for every rank
        wrapped()
        sampler = copy.copy(sampler)
        sampler.dataset = copy.copy(sampler.dataset)
        sampler.dataset.reset = lambda: None
    per_rank = [_indices_of(sampler, world, r, epoch) for r in range(world)]
    batch = getattr(loader, "batch_size", None) or 1
    drop = bool(getattr(loader, "drop_last", False))
    out.update(samples=samples, batch_size=batch, drop_last=drop, shuffle=bool(getattr(sampler, "shuffle", False)),
               sampler_drop_last=bool(sampler.drop_last), sampler=type(sampler).__name__)
    out.update(_counts(per_rank, samples, batch, drop, _labels(getattr(loader, "dataset", None))))
    return out


def _counts(per_rank: list[list[int]], samples: int, batch: int, drop: bool, labels: list | None) -> dict:
    """Duplicates, samples no rank reads, batches per rank and classes left out of ``per_rank``."""
    seen: dict[int, list[int]] = {}
    kept = set()
    batches = []
    for r, indices in enumerate(per_rank):
        n_batches = len(indices) // batch if drop else math.ceil(len(indices) / batch)
        batches.append(n_batches)
        kept.update(indices[: n_batches * batch] if drop else indices)
        for i in indices:
            seen.setdefault(i, []).append(r)
    twice = {i: ranks for i, ranks in seen.items() if len(ranks) > 1}
    unread = sorted(set(range(samples)) - set(seen))
    dropped = sorted(set(seen) - kept)
    out = {"duplicates": len(twice), "duplicate_examples": sorted(twice.items())[:3],
           "unread": len(unread) + len(dropped), "unread_examples": (unread + dropped)[:5],
           "batches": {"min": min(batches), "max": max(batches),
                       "fewer": [r for r, b in enumerate(batches) if b < max(batches)][:8]}}
    if labels is not None and len(labels) == samples:
        classes = set(labels)
        read = {labels[i] for i in kept}
        out["classes_left_out"] = sorted(classes - read, key=str)[:5]
    return out


def sentences(p: dict | None, stage: str) -> tuple[str | None, list[str]]:
    """(note, findings) of a plan: the note says what every rank of the production world reads
    (a DistributedSampler gives every rank the same count, padding the last round); findings are
    the faults it shows (a class no rank reads)."""
    if not p:
        return None, []
    world = f"at the production size (num_nodes {p['nodes']} x devices {p['devices']} = {p['world']} ranks)"
    if p.get("not_computed"):
        return f"{world} the {stage} split was not computed: {p['not_computed']}.", []
    b = p["batches"]
    parts = [f"each rank reads {b['max']} {stage} batch{'es' if b['max'] != 1 else ''} of {p['batch_size']}"
             if b["min"] == b["max"] else f"ranks read {b['min']} to {b['max']} {stage} batches"]
    if p["duplicates"]:
        first, ranks = p["duplicate_examples"][0]
        parts.append(f"{p['duplicates']} of the {p['samples']} samples are read twice ({p['sampler']} pads the "
                     f"last round: sample {first} by ranks {' and '.join(map(str, ranks))})")
    if p["unread"]:
        parts.append(f"{p['unread']} samples are read by no rank ("
                     + ("drop_last drops the last batch of each rank" if p["drop_last"] else
                        "the sampler's drop_last cuts the last round") + ")")
    left_out = ", ".join(map(str, p.get("classes_left_out") or []))
    if left_out and p["shuffle"]:
        # A shuffled order drops other samples in another epoch: said, not failed.
        parts.append(f"in epoch 0 no rank reads any sample of class(es) {left_out} (shuffled: another epoch drops "
                     f"other samples)")
    note = f"{world}: " + "; ".join(parts) + "."
    findings = []
    if left_out and not p["shuffle"]:
        findings.append(f"{world} no rank reads any sample of class(es) {left_out}: drop_last drops every one of "
                        f"them, in every epoch (the sampler does not shuffle)")
    return note, findings
