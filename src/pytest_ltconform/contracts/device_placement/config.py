"""device-placement, pytest side: the ranks the user's Trainer config is written for.

The verdict is judged against the production config (``Trainer(accelerator=..., devices=...,
num_nodes=..., strategy=...)``), not against the CPU world it was observed in: a fault that breaks
NCCL ranks fails where the config is for GPUs (``"gpu"``, ``"cuda"``, or ``"auto"``, which
Lightning resolves to CUDA on a GPU runner) and is an advisory where it is CPU-only.
"""

from __future__ import annotations

import dataclasses

from ...trainer_overrides import on_gpus

_FORKING = ("ddp_fork", "ddp_notebook")


@dataclasses.dataclass(frozen=True)
class Production:
    """The user's config as the verdict reads it. ``gpu``: 'gpu', 'auto' or None (CPU-only);
    ``per_node``: devices per node (None: every GPU of the node, as ``devices="auto"`` or ``-1``
    take them); ``nodes``; ``strategy`` (its name or class); ``start`` (how the strategy starts its
    processes: 'fork', 'spawn' or None for already started ones)."""

    gpu: str | None
    accelerator: object = None
    per_node: int | None = None
    nodes: int = 1
    strategy: object = None
    start: str | None = None

    @classmethod
    def of(cls, facts: dict | None) -> Production:
        facts = facts or {}
        strategy, method = facts.get("strategy"), facts.get("start_method")
        start = "fork" if (isinstance(strategy, str) and strategy.lower().startswith(_FORKING)) or \
            method in ("fork", "forkserver") else "spawn" if (isinstance(strategy, str) and strategy.lower().startswith(
                "ddp_spawn")) or method == "spawn" else None
        nodes = facts.get("num_nodes")
        return cls(gpu=on_gpus(facts.get("accelerator")), accelerator=facts.get("accelerator"),
                   per_node=_per_node(facts.get("devices")), nodes=nodes if isinstance(nodes, int) and nodes > 0 else 1,
                   strategy=strategy, start=start)

    @property
    def several_per_node(self) -> bool:
        """More than one GPU rank on a node (``devices`` of more than one, or every GPU there)."""
        return self.per_node is None or self.per_node > 1

    @property
    def several_ranks(self) -> bool:
        return self.several_per_node or self.nodes > 1

    def breaks(self, needs: str = "gpu") -> bool:
        """Whether a fault that shows on GPU ranks (``needs``: 'gpu' on any GPU rank, 'ranks' with
        more than one rank, 'node' with more than one GPU rank per node, 'nodes' on more than one
        node, 'never' for waste that breaks nothing) breaks the configured run: the finding fails;
        otherwise it is an advisory."""
        if self.gpu is None:
            return False
        return {"gpu": True, "ranks": self.several_ranks, "node": self.several_per_node,
                "nodes": self.nodes > 1, "never": False}[needs]

    def words(self) -> str:
        """The config as a sentence names it: ``accelerator='auto' (CUDA on a GPU runner), devices=every GPU``."""
        acc = "accelerator not set ('auto': CUDA on a GPU runner)" if self.accelerator is None else \
            f"accelerator={self.accelerator!r}" + (" (CUDA on a GPU runner)" if self.gpu == "auto" else "")
        nodes = f", num_nodes={self.nodes}" if self.nodes != 1 else ""
        if self.gpu is None:
            return f"{acc}{nodes}"
        devices = "devices=every GPU of the node" if self.per_node is None else f"devices={self.per_node}"
        return f"{acc}, {devices}{nodes}"


def _per_node(devices) -> int | None:
    if devices is None or devices in ("auto", -1, "-1"):
        return None
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str):
        if "," in devices:  # "0,1": those GPUs; "1,": GPU 1 alone
            return len([p for p in devices.split(",") if p.strip()])
        return int(devices) if devices.strip().lstrip("-").isdigit() and int(devices) > 0 else None
    return devices if isinstance(devices, int) and devices > 0 else None
