"""Rank side: the bytes of parameters, gradients and optimizer state one rank really holds.

Tensors are found where each strategy keeps them: the wrapped model's parameters (FSDP's flat
shards, DeepSpeed ZeRO-3's ``ds_tensor`` partitions), their ``.grad``, the torch optimizer's
``state``, and the partitions a DeepSpeed ZeRO optimizer keeps itself (fp32 master weights and
gradient partitions). Every storage is counted once, in the first category that reaches it, so
views into one flat buffer and a master copy that is the parameter itself are not counted twice.
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
    ledger.add("params", params + [p.ds_tensor for p in params if getattr(p, "ds_tensor", None) is not None])
    grads = [p.grad for p in params if p.grad is not None]
    optimizers = [o for opt in trainer.optimizers for o in _inner_optimizers(opt)]
    masters: list = []
    for opt in optimizers:
        for name in _ZERO_GRADS:
            _tensors(getattr(opt, name, None), grads)
        for name in _ZERO_MASTER:
            _tensors(getattr(opt, name, None), masters)
    grads += [m.grad for m in masters if m.grad is not None]
    ledger.add("grads", grads)
    state: list = []
    for opt in optimizers:
        _tensors(getattr(opt, "state", None) if isinstance(getattr(opt, "state", None), dict) else None, state)
    ledger.add("optimizer", masters + state)
    return {"bytes": ledger.bytes, "storages": ledger.storages}
