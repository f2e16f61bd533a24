"""The GPU tier: local NCCL ranks, one CUDA device each, under the real strategy classes."""

from __future__ import annotations

from ..vocabulary import GPU_STRATEGIES
from .base import Tier, Variant, contract_tiers


class GpuTier(Tier):
    """Items ``ddp-gpu``, ``fsdp-gpu``; needs ``world_size`` CUDA devices."""

    name = "gpu"
    marker_name = "ltconform_gpu"
    enable_hint = "on a GPU runner: -m ltconform_gpu; docs/ci.md"
    cuda = True

    def missing(self, here) -> str | None:
        launched = self.in_launched_world(here)
        if launched:
            return launched
        found = here.cuda_count()
        return f"needs {here.world_size} CUDA devices, found {found}" if found < here.world_size else None

    def variants(self, contract, selected, local_supported, nodes=None) -> list[Variant]:
        if self.name not in contract_tiers(contract):
            return []
        return [Variant(self.name, s, f"{s}-gpu", (self.marker(),), (self.name,)) for s in contract.strategies
                if s in GPU_STRATEGIES and s != "deepspeed" and s in selected]
