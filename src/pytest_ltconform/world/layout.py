"""How a world's ranks sit on nodes, as one value: ``nodes`` x ``ranks_per_node``. Pure data.

A local world today runs one node (``Layout.single_node(world_size)``); the rank environment
(``LocalWorld._rank_env``: NODE_RANK, LOCAL_RANK, GROUP_RANK, ...) and the job's node count are
read from the layout, so several nodes on one host change this value, not the supervisor.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Layout:
    """``nodes`` nodes of ``ranks_per_node`` ranks each; global rank ``r`` sits on node
    ``r // ranks_per_node`` as local rank ``r % ranks_per_node`` (torchrun's numbering)."""

    nodes: int = 1
    ranks_per_node: int = 2

    def __post_init__(self):
        if not (isinstance(self.nodes, int) and isinstance(self.ranks_per_node, int)) \
                or self.nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(f"a layout needs at least 1 node of at least 1 rank, got {self.nodes} x "
                             f"{self.ranks_per_node}")

    @classmethod
    def single_node(cls, world_size: int) -> Layout:
        """``world_size`` ranks on one node: every local world today."""
        return cls(1, world_size)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_rank(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def __str__(self) -> str:
        return f"{self.nodes}x{self.ranks_per_node}"
