"""The multinode tier: the world pytest itself runs in, started by torchrun or SLURM across nodes.
The plugin starts no rank for it; its items are decided once the ranks agreed on the collection
(and so on the nodes they span)."""

from __future__ import annotations

from ..vocabulary import CPU_CORE_STRATEGIES
from .base import Tier, Variant, contract_tiers


class MultinodeTier(Tier):
    """Items ``ddp-multinode``, ``fsdp-multinode``; needs an attached world of 2 or more nodes."""

    name = "multinode"
    marker_name = "ltconform_multinode"
    enable_hint = "under torchrun or srun across nodes: -m ltconform_multinode; docs/ci.md"
    local = False

    def missing(self, here) -> str | None:
        a = here.attached
        if a is None:
            return ("not inside a multi-node world: no torchrun or SLURM launch found in this pytest "
                    "process (run pytest under `torchrun --nnodes N ...` or `srun -N N ...`; see docs/ci.md)")
        nodes = here.num_nodes or 1
        if nodes < 2:
            return (f"not inside a multi-node world: pytest is {a.describe()}, all on "
                    f"{nodes} node; the multinode tier needs 2 or more nodes")
        return None

    def decided(self, here) -> bool:
        return here.attached is None or here.num_nodes is not None

    def variants(self, contract, selected, local_supported, nodes=None) -> list[Variant]:
        if self.name not in contract_tiers(contract):
            return []
        return [Variant(self.name, s, f"{s}-multinode", (self.marker(),), (self.name,)) for s in contract.strategies
                if s in selected and s in local_supported and s in CPU_CORE_STRATEGIES]

    def layout(self, world_size: int, nodes=None):
        return None  # the launcher's: known to the attached world once its ranks agreed

    def world(self, pool, attached, layout, pg_timeout_s: float):
        from ..world import WorldStartError

        if attached is None:
            raise WorldStartError("the multinode tier runs only inside a torchrun or SLURM world")
        return attached

    def reference_world(self, pool, pg_timeout_s: float):
        return None  # every rank runs every job of a launched world, and the plugin starts none

    def run_label(self, strategy: str, nodes=None) -> str:
        return strategy

    def item_label(self, strategy: str, nodes=None) -> str:
        return f"{strategy}-multinode"
