"""Tiers: which worlds a contract item runs in, what each tier needs, and how to tell that
pytest itself is one rank of a world that torchrun or SLURM started.

Every generated item is one (contract, variant). A variant names the tier, the strategy and the
world parameters; the rank-side code path is the same for all of them, only the world differs.
Each tier is one class (``base.Tier``: ``missing``, ``variants``, ``world``, ``marker``, and the
``layout`` its worlds take), one per module, picked by name in ``registry``:

========== ====================== ============================ =========================================
tier       item parameter         world                        needs
========== ====================== ============================ =========================================
cpu        ``ddp``, ``fsdp``,      local ranks, gloo, CPU       nothing (skipped only inside a launched
           ``deepspeed``                                       world, where the plugin spawns nothing);
                                                               ``deepspeed`` needs deepspeed importable
gpu        ``ddp-gpu``,           local ranks, NCCL,           ``world_size`` CUDA devices
           ``fsdp-gpu``           ``accelerator="gpu"``
deepspeed  ``deepspeed-gpu``      as gpu, real DeepSpeedStrategy deepspeed importable, and the gpu tier
multinode  ``ddp-multinode``,     the world pytest runs in     an attached world of 2 or more nodes
           ``fsdp-multinode``     (torchrun / SLURM)
========== ====================== ============================ =========================================

Nothing here imports torch or lightning at module level; the checks import them when called.
This module is the package's interface: the names below come from its modules.
"""

from __future__ import annotations

from ..world.devices import cuda_device_count
from .attached import Attached, detect_attached
from .availability import Availability
from .base import Tier, Variant, contract_tiers
from .deepspeed import deepspeed_missing, deepspeed_not_found, not_importable, quiet_deepspeed_detection
from .marks import MarkExpression
from .registry import ORDER, get, variants
from .selection import hidden_reason, not_run_line

__all__ = ["ORDER", "Attached", "Availability", "MarkExpression", "Tier", "Variant", "contract_tiers",
           "cuda_device_count", "deepspeed_missing", "deepspeed_not_found", "detect_attached", "get",
           "hidden_reason", "not_importable", "not_run_line", "quiet_deepspeed_detection", "variants"]
