"""Whether each tier can run here, asked once per session per tier."""

from __future__ import annotations

from ..world.devices import cuda_device_count
from ..world.layout import Layout
from .attached import Attached
from .base import Variant
from .deepspeed import deepspeed_missing
from .registry import get


class Availability:
    """Answers "can this tier run here, and if not, why not" once per session per tier.

    ``attached`` is the launched world pytest runs in (None when local); ``num_nodes`` the
    number of nodes that world spans, as agreed by every rank at collection time; ``nodes`` the
    layout of the nodes tier's local worlds (None: ``--ltconform-nodes 1``).
    """

    def __init__(self, world_size: int, attached: Attached | None = None, num_nodes: int | None = None,
                 cuda_count=cuda_device_count, deepspeed_missing=deepspeed_missing, nodes: Layout | None = None):
        self.world_size = world_size
        self.nodes = nodes
        self.attached = attached
        self.num_nodes = num_nodes
        self._cuda_count = cuda_count
        self._deepspeed_missing = deepspeed_missing
        self._cache: dict[str, str | None] = {}

    def missing(self, tier: str) -> str | None:
        """None when ``tier`` can run here, else the reason naming what is missing (the tier's own
        answer, :meth:`~.base.Tier.missing`, asked once). ValueError names an unknown tier."""
        if tier not in self._cache:
            self._cache[tier] = get(tier).missing(self)
        return self._cache[tier]

    def cuda_count(self) -> int:
        """CUDA devices this process sees (or the process that validated the targets saw)."""
        return self._cuda_count()

    def deepspeed_missing(self) -> str | None:
        """Why DeepSpeed cannot run here, or None (see ``deepspeed.deepspeed_missing``)."""
        return self._deepspeed_missing()

    def first_missing(self, variant: Variant) -> tuple[str, str] | None:
        """(tier, reason) for the first tier ``variant`` needs that is missing, else None."""
        for tier in variant.needs:
            reason = self.missing(tier)
            if reason:
                return tier, reason
        return None
