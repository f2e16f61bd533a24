"""Rank side: the bytes of parameters, gradients and optimizer state one rank really holds.

Tensors are found where each strategy keeps them: the wrapped model's parameters (FSDP's flat
shards, DeepSpeed ZeRO-3's ``ds_tensor`` partitions), their ``.grad``, the torch optimizer's
``state``, and the partitions a DeepSpeed ZeRO optimizer keeps itself (fp32 master weights and
gradient partitions). Every storage is counted once, in the first category that reaches it, so
views into one flat buffer and a master copy that is the parameter itself are not counted twice.
A ZeRO gradient partition counts the bytes it views (the rank's share), not the buffer of every
gradient it is a view into. Buffers count with the parameters.
"""

from __future__ import annotations

from typing import Any

CATEGORIES = ("params", "grads", "optimizer")

# DeepSpeed ZeRO optimizer attributes, by category (stage_1_and_2.py and stage3.py of DeepSpeed).
_ZERO_MASTER = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
_ZERO_GRADS = ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer")


def _tensors(obj: Any, out: list, depth: int = 0) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth < 4 and isinstance(obj, dict):
        for value in obj.values():
            _tensors(value, out, depth + 1)
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for value in obj:
            _tensors(value, out, depth + 1)


class _Ledger:
    """Bytes per category, each untyped storage counted once."""

    def __init__(self):
        self.seen: set[int] = set()
        self.bytes = dict.fromkeys(CATEGORIES, 0)
        self.storages = dict.fromkeys(CATEGORIES, 0)

    def add(self, category: str, tensors: list) -> None:
        for t in tensors:
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            size = storage.nbytes()
            if size == 0 or storage.data_ptr() in self.seen:
                continue
            self.seen.add(storage.data_ptr())
            self.bytes[category] += size
            self.storages[category] += 1

    def add_views(self, category: str, tensors: list) -> None:
        """Only the bytes these views cover (each byte once), not their whole storages: a ZeRO
        rank's gradient partition is a view into a buffer the size of every gradient."""
        covered: dict[int, set] = {}
        for t in tensors:
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            key = storage.data_ptr()
            if storage.nbytes() == 0 or (key in self.seen and key not in covered):
                continue
            start = t.storage_offset() * t.element_size()
            ranges = covered.setdefault(key, set())
            ranges.add((start, start + t.numel() * t.element_size()))
        for key, ranges in covered.items():
            self.seen.add(key)
            self.bytes[category] += _union(ranges)
            self.storages[category] += 1


def _union(ranges: set) -> int:
    """Bytes covered by half-open byte ranges."""
    total, end = 0, -1
    for lo, hi in sorted(ranges):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def _inner_optimizers(optimizer: Any) -> list:
    """``optimizer`` and what it wraps (Lightning's LightningOptimizer, a ZeRO optimizer's torch one)."""
    found, todo = [], [optimizer]
    while todo and len(found) < 4:
        opt = todo.pop()
        if opt is None or any(opt is f for f in found):
            continue
        found.append(opt)
        todo.extend(getattr(opt, name, None) for name in ("_optimizer", "optimizer"))
    return found


def held(trainer: Any) -> dict:
    """``{"bytes": {category: n}, "storages": {category: n}}`` of what this rank holds now."""
    ledger = _Ledger()
    model = getattr(trainer.strategy, "model", None) or trainer.lightning_module
    params = list(model.parameters()) + [p for p in trainer.lightning_module.parameters()]
    # Buffers count with the parameters, as in the predicted figures (no strategy shards them).
    buffers = list(model.buffers()) + list(trainer.lightning_module.buffers())
    ledger.add("params", params + [p.ds_tensor for p in params if getattr(p, "ds_tensor", None) is not None]
               + buffers)
    optimizers = [o for opt in trainer.optimizers for o in _inner_optimizers(opt)]
    partitions: list = []
    masters: list = []
    for opt in optimizers:
        for name in _ZERO_GRADS:
            _tensors(getattr(opt, name, None), partitions)
        for name in _ZERO_MASTER:
            _tensors(getattr(opt, name, None), masters)
    ledger.add_views("grads", partitions)  # first: the rank owns the partition, not the buffer it views
    ledger.add("grads", [p.grad for p in params if p.grad is not None] + [m.grad for m in masters
                                                                          if m.grad is not None])
    state: list = []
    for opt in optimizers:
        _tensors(getattr(opt, "state", None) if isinstance(getattr(opt, "state", None), dict) else None, state)
    ledger.add("optimizer", masters + state)
    return {"bytes": ledger.bytes, "storages": ledger.storages}


class Activations:
    """Bytes of the tensors autograd saves during one training_step, each storage counted once,
    parameters and their views not counted: what 'activations' means in measured and predicted
    figures alike (the predicted step counts them with this on fake tensors)."""

    def __init__(self):
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, tensor):
        import torch
        from torch._subclasses.fake_tensor import is_fake

        base = tensor._base if tensor._base is not None else tensor
        if not isinstance(base, torch.nn.Parameter) and not isinstance(tensor, torch.nn.Parameter):
            try:
                storage = tensor.untyped_storage()
                key = storage._cdata if is_fake(tensor) else storage.data_ptr()  # a fake one has no data
                if key not in self.seen and storage.nbytes():
                    self.seen.add(key)
                    self.bytes += storage.nbytes()
            except Exception:  # a tensor subclass without storage: counting must not break the step
                pass
        return tensor

    @staticmethod
    def unpack(tensor):
        return tensor
