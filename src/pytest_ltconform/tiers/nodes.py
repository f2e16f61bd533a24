"""The nodes tier: local gloo ranks on this host laid out as several nodes (default 2 nodes x 1 rank).

Each rank gets what a launcher sets on a real node (NODE_RANK/GROUP_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_WORLD_SIZE, WORLD_SIZE, RANK) and its node's own temp storage (``world.nodes``); the Trainer
runs with ``num_nodes=N, devices=M``. What only a second node shows (a split by the local rank, a
file on one node's /tmp that another node reads, a local-rank-zero guard on a shared file) shows
here, on one host, in a default run. Its worlds are forked by the CPU tier's parent: one more fit
per target.
"""

from __future__ import annotations

from ..vocabulary import NODE_STRATEGIES
from ..world.layout import Layout
from .base import CPU_RANK_ENV, Tier, Variant, contract_tiers


class NodesTier(Tier):
    """Items ``ddp-2nodes`` (and ``fsdp-2nodes`` where the Trainer config names FSDP); needs
    nothing but not being a rank of a launched world, and a layout of 2 or more nodes
    (``--ltconform-nodes``)."""

    name = "nodes"
    marker_name = "ltconform_nodes"
    enable_hint = "--ltconform-nodes 2 (the default); docs/ci.md"

    def missing(self, here) -> str | None:
        launched = self.in_launched_world(here)
        if launched:
            return launched
        if here.nodes is None:
            return "--ltconform-nodes 1: no local world of several nodes is started"
        return None

    def variants(self, contract, selected, local_supported, nodes: Layout | None = None) -> list[Variant]:
        if self.name not in contract_tiers(contract) or nodes is None:
            return []
        return [Variant(self.name, s, label(s, nodes), (self.marker(),), (self.name,), configured_only=(s != "ddp"))
                for s in contract.strategies if s in NODE_STRATEGIES and s in selected and s in local_supported]

    def layout(self, world_size: int, nodes: Layout | None = None) -> Layout | None:
        return nodes

    def rank_env(self) -> dict:
        return dict(CPU_RANK_ENV)

    def run_label(self, strategy: str, nodes: Layout | None = None) -> str:
        return label(strategy, nodes)


def label(strategy: str, nodes: Layout | None) -> str:
    """The item parameter of ``strategy`` on ``nodes``: ``ddp-2nodes``."""
    return f"{strategy}-{nodes.nodes if nodes is not None else 2}nodes"
