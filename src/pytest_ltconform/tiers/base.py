"""What every tier answers, and the variant an item runs in.

A tier is one small class (``cpu.py``, ``gpu.py``, ``deepspeed.py``, ``multinode.py``) answering
the same questions: what is missing for it here (:meth:`Tier.missing`), which items a contract has
in it (:meth:`Tier.variants`), which world its runs go to (:meth:`Tier.world`, with the layout of
:meth:`Tier.layout`) and its pytest marker (:meth:`Tier.marker`). Nothing here imports torch or
lightning.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..vocabulary import DEFAULT_CONTRACT_TIERS
from ..world.layout import Layout

# Environment of every rank of a CPU world. DeepSpeed picks its accelerator once, at import: on
# CPU ranks it must be the CPU one, also on a host with GPUs. One-rank reference runs go there too.
CPU_RANK_ENV = {"DS_ACCELERATOR": "cpu"}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One world an item runs in.

    ``label`` is the item parameter (``all-rank-save[ddp-gpu]``); ``markers`` the pytest markers
    besides ``ltconform``; ``needs`` the tiers whose availability is checked, in order, before
    the item runs (the first missing one names the skip reason); ``configured_only``: the item
    exists only for a target whose Trainer config names its strategy (``fsdp-2nodes``).
    """

    tier: str
    strategy: str
    label: str
    markers: tuple[str, ...]
    needs: tuple[str, ...]
    configured_only: bool = False


def contract_tiers(contract) -> tuple[str, ...]:
    """The tiers a contract has items in: its ``tiers`` attribute, else cpu, gpu and multinode."""
    return tuple(getattr(contract, "tiers", None) or DEFAULT_CONTRACT_TIERS)


class Tier:
    """One tier. ``name`` is its word (``vocabulary.TIERS``); ``enable_hint`` how to run it where it
    cannot run (the header's hint); ``cuda``: its ranks sit on CUDA devices (NCCL); ``local``: the
    plugin starts its ranks (False: the launched world pytest runs in, whose layout and
    availability are known only once its ranks agreed on the collection)."""

    name: str = ""
    marker_name: str = ""
    enable_hint: str = "docs/ci.md"
    cuda: bool = False
    local: bool = True

    def marker(self) -> str:
        """The pytest marker of this tier's items (registered by the plugin)."""
        return self.marker_name

    def missing(self, here) -> str | None:
        """None when this tier can run here, else the reason naming what is missing; ``here`` is
        the session's ``availability.Availability`` (world size, the launched world if any, its
        node count, the CUDA device count and DeepSpeed's import, each asked once)."""
        raise NotImplementedError

    def decided(self, here) -> bool:
        """Whether :meth:`missing` can be answered yet (the multinode tier waits for the ranks of
        a launched world to agree on their nodes)."""
        return True

    def variants(self, contract, selected: tuple[str, ...], local_supported: tuple[str, ...],
                 nodes: Layout | None = None) -> list[Variant]:
        """The items ``contract`` has in this tier, in item order. ``selected`` are the strategies
        the user asked for (``--ltconform-strategies``); ``local_supported`` the strategies the CPU
        tier can run today; ``nodes`` the layout of the nodes tier's worlds (None: no such world,
        ``--ltconform-nodes 1``)."""
        raise NotImplementedError

    @property
    def backend(self) -> str:
        """The process-group backend of this tier's worlds: 'nccl' on CUDA tiers, else 'gloo'."""
        return "nccl" if self.cuda else "gloo"

    def rank_env(self) -> dict:
        """Variables set in each rank of this tier's local worlds (a new dict)."""
        return {}

    def layout(self, world_size: int, nodes: Layout | None = None) -> Layout | None:
        """How this tier's runs place their ranks on nodes: ``world_size`` ranks on one node (a
        local world); ``nodes`` (the session's node layout) on the nodes tier; None where the
        world's launcher decided it (the attached world)."""
        return Layout.single_node(world_size)

    def world(self, pool, attached, layout: Layout | None, pg_timeout_s: float) -> Any:
        """The ``world.World`` a run of this tier goes to: the pool's local world of ``layout``
        with this tier's backend and rank environment. Raises ``world.WorldStartError`` when
        there is none."""
        return pool.get(layout, self.backend, pg_timeout_s, self.rank_env())

    def reference_world(self, pool, pg_timeout_s: float) -> Any | None:
        """The one-rank CPU world beside this tier's where a reference run (``RunSpec.reference``)
        goes; None where the plugin starts no world."""
        return pool.get(Layout.single_node(1), "gloo", pg_timeout_s, dict(CPU_RANK_ENV))

    def run_label(self, strategy: str, nodes: Layout | None = None) -> str:
        """How progress lines name a run of ``strategy`` in this tier (``fit[ddp-gpu]``)."""
        return strategy + ("-gpu" if self.cuda else "")

    def item_label(self, strategy: str, nodes: Layout | None = None) -> str:
        """The item parameter of ``strategy`` in this tier (``sync-dist[ddp-gpu]``), as messages
        that name another item spell it."""
        return self.run_label(strategy, nodes)

    def in_launched_world(self, here) -> str | None:
        """The reason a local tier does not run when pytest is a rank of a launched world (its
        ranks must not start worlds of their own); None outside one."""
        if here.attached is None:
            return None
        return (f"pytest is {here.attached.describe()}: the {self.name} tier starts local ranks, which the plugin "
                f"never does inside a launched world; run this tier without torchrun/srun, or select "
                f"-m ltconform_multinode here")
