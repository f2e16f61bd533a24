"""The CPU tier: local gloo ranks on this machine, under ddp, CPU FSDP and real DeepSpeed on CPU."""

from __future__ import annotations

from .base import CPU_RANK_ENV, Tier, Variant, contract_tiers
from .deepspeed import DeepSpeedTier


class CpuTier(Tier):
    """Items ``ddp``, ``fsdp``, ``deepspeed``; needs nothing but not being a rank of a launched
    world (the plugin spawns nothing there); the ``deepspeed`` item also needs DeepSpeed."""

    name = "cpu"
    marker_name = "ltconform_cpu"
    enable_hint = "run it without torchrun/srun; docs/ci.md"

    def missing(self, here) -> str | None:
        return self.in_launched_world(here)

    def variants(self, contract, selected, local_supported, nodes=None) -> list[Variant]:
        if self.name not in contract_tiers(contract):
            return []
        return [self._variant(s) for s in contract.strategies if s in selected and s in local_supported]

    def _variant(self, strategy: str) -> Variant:
        if strategy == "deepspeed":  # real DeepSpeed on gloo ranks: needs the package, not a GPU
            return Variant(self.name, strategy, strategy, (self.marker(), DeepSpeedTier.marker_name),
                           (self.name, DeepSpeedTier.name))
        return Variant(self.name, strategy, strategy, (self.marker(),), (self.name,))

    def rank_env(self) -> dict:
        return dict(CPU_RANK_ENV)
