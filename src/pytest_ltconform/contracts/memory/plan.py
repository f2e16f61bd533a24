"""Pytest side: per-device bytes of a traced step under each strategy, and how they are shown.

Rules section "Choose using measured memory": DDP keeps a whole replica of weights, gradients and
optimizer state on every device; FSDP and DeepSpeed ZeRO shard that state over the devices. The
activations of one device's batch are not sharded by any of them. A strategy that shards the
weights also gathers one block's weights whole while that block runs (the largest block counts).
Pure arithmetic over plain data: no torch.
"""

from __future__ import annotations

import math

# label -> which of (params, grads, optimizer) are divided over the devices, and whether one
# block's weights are gathered whole during the step.
SHARDING = {
    "DDP": ((), False),
    "FSDP FULL_SHARD": (("params", "grads", "optimizer"), True),
    "FSDP SHARD_GRAD_OP": (("grads", "optimizer"), False),
    "FSDP NO_SHARD": ((), False),
    # Hybrid: sharded over one node's devices (``per_node``), replicated across nodes.
    "FSDP HYBRID_SHARD": (("params", "grads", "optimizer"), True),
    "FSDP _HYBRID_SHARD_ZERO2": (("grads", "optimizer"), False),
    "DeepSpeed ZeRO-0": ((), False),
    "DeepSpeed ZeRO-1": (("optimizer",), False),
    "DeepSpeed ZeRO-2": (("grads", "optimizer"), False),
    "DeepSpeed ZeRO-3": (("params", "grads", "optimizer"), True),
}
# The strategies a verdict names as alternatives, in the order it names them.
CANDIDATES = ("DDP", "FSDP FULL_SHARD", "FSDP SHARD_GRAD_OP", "DeepSpeed ZeRO-1", "DeepSpeed ZeRO-2",
              "DeepSpeed ZeRO-3")


# Trainer precisions under which DeepSpeed runs the module in half precision (Lightning gives
# DeepSpeed an fp16/bf16 config for them).
MIXED = ("16-mixed", "bf16-mixed", "16", "bf16")
_TOTALLED = ("params", "grads", "optimizer", "gathered", "activations", "temporaries")


def _state(label: str, prediction: dict) -> dict:
    """The unsharded state one replica holds under ``label``. A ZeRO optimizer (stages 1-3) steps an
    fp32 copy of the weights, partitioned with its state, whatever the precision (the ranks measure
    it: single_partition_of_fp32_groups, fp32_partitioned_groups_flat); it is counted with the
    optimizer state. Under a mixed precision DeepSpeed holds the weights and gradients in half
    precision (the trace keeps them fp32), and stage 0 keeps an fp32 master copy too."""
    state = dict(prediction["bytes"])
    if not label.startswith("DeepSpeed"):
        return state
    # the weights' fp32 bytes: traced fp32 under a mixed precision or 32-true, half under a *-true one
    fp32 = state["params"] * (2 if prediction.get("precision") in ("16-true", "bf16-true") else 1)
    mixed = prediction.get("precision") in MIXED
    if mixed or not label.endswith("ZeRO-0"):
        state["optimizer"] += fp32
    if mixed:
        state.update(params=state["params"] // 2, grads=state["grads"] // 2)
    return state


def per_device(label: str, prediction: dict, world: int) -> dict:
    """Bytes per category on one of ``world`` devices under ``label`` for a traced ``prediction``
    (see predict.predict); ``total`` is the step's per-device peak as counted here: the state as
    ``label`` divides it, the parameters' buffers, one gathered block, the activations (saved for
    backward) and the other temporaries the traced step held at its peak."""
    divided, gathers = SHARDING.get(label, ((), False))
    state = _state(label, prediction)
    over = min(world, prediction.get("per_node") or world) if "HYBRID" in label else world
    row = {cat: math.ceil(state[cat] / over) if cat in divided else state[cat]
           for cat in ("params", "grads", "optimizer")}
    row["params"] += state.get("buffers", 0)
    row["gathered"] = prediction.get("unit_bytes", 0) if gathers and over > 1 else 0
    row["activations"] = prediction["activations"]
    row["temporaries"] = prediction.get("temporaries", 0)
    row["total"] = sum(row[k] for k in _TOTALLED)
    return row


def fits(prediction: dict, world: int, capacity: int) -> list[tuple[str, dict]]:
    """The candidate strategies whose per-device peak on ``world`` devices fits ``capacity`` bytes."""
    rows = [(label, per_device(label, prediction, world)) for label in CANDIDATES]
    return [(label, row) for label, row in rows if row["total"] <= capacity]


_UNITS = (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10))


def size(n: int | float) -> str:
    """Bytes in binary units, e.g. '31.2 GiB', '264 B'."""
    for unit, scale in _UNITS:
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def row_text(label: str, row: dict, world: int) -> str:
    """'FSDP FULL_SHARD on 8 devices: 31.2 GiB per device (params ..., grads ..., ...)'."""
    parts = [f"params {size(row['params'])}", f"grads {size(row['grads'])}",
             f"optimizer {size(row['optimizer'])}", f"activations {size(row['activations'])}"]
    if row.get("temporaries"):
        parts.append(f"other temporaries at the peak {size(row['temporaries'])}")
    if row.get("gathered"):
        parts.append(f"largest block gathered {size(row['gathered'])}")
    devices = "device" if world == 1 else "devices"
    return f"{label} on {world} {devices}: {size(row['total'])} per device ({', '.join(parts)})"
