"""The tiers, in item order, and the one place a tier's name picks its class."""

from __future__ import annotations

from ..world.layout import Layout
from .base import Tier, Variant
from .cpu import CpuTier
from .deepspeed import DeepSpeedTier
from .gpu import GpuTier
from .multinode import MultinodeTier
from .nodes import NodesTier

# Item order: CPU first, then its worlds of several nodes, GPU, DeepSpeed, multi-node.
ORDER: tuple[Tier, ...] = (CpuTier(), NodesTier(), GpuTier(), DeepSpeedTier(), MultinodeTier())
_BY_NAME = {tier.name: tier for tier in ORDER}
# The nodes tier's layout when nothing says otherwise (settings.default_nodes decides it per machine).
DEFAULT_LAYOUT = Layout(2, 1)


def get(name: str) -> Tier:
    """The tier called ``name`` (one of ``vocabulary.TIERS``); ValueError names an unknown one."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown tier {name!r}") from None


def variants(contract, selected: tuple[str, ...], local_supported: tuple[str, ...],
             nodes: Layout | None = DEFAULT_LAYOUT) -> list[Variant]:
    """Every variant of ``contract``, in item order: each tier's (:meth:`Tier.variants`).

    ``selected`` are the strategies the user asked for (``--ltconform-strategies``);
    ``local_supported`` the strategies the CPU tier can run today; ``nodes`` the nodes tier's
    layout (None: ``--ltconform-nodes 1``, no items there).
    """
    return [v for tier in ORDER for v in tier.variants(contract, selected, local_supported, nodes)]
