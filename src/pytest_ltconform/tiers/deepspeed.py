"""The DeepSpeed tier: the GPU tier's worlds with the real ``DeepSpeedStrategy``; it needs DeepSpeed
importable (its CPU item, ``deepspeed``, belongs to the CPU tier and needs that too). Also how this
process finds out whether DeepSpeed imports, and keeps its import quiet."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os

from ..vocabulary import SHARDED_STRATEGIES
from ..world.devices import cuda_device_count
from .base import Tier, Variant, contract_tiers


class DeepSpeedTier(Tier):
    """Item ``deepspeed-gpu``, for a contract with gpu items and a sharded strategy; needs
    DeepSpeed importable here, and the gpu tier."""

    name = "deepspeed"
    marker_name = "ltconform_deepspeed"
    enable_hint = "once installed, the [deepspeed] items run; docs/ci.md"
    cuda = True
    gpu_marker = "ltconform_gpu"  # its items are GPU items too (gpu.GpuTier's marker)

    def missing(self, here) -> str | None:
        return self.in_launched_world(here) or here.deepspeed_missing()

    def item_label(self, strategy: str, nodes=None) -> str:
        return "deepspeed-gpu"

    def variants(self, contract, selected, local_supported, nodes=None) -> list[Variant]:
        # The DeepSpeed tier's item comes with the gpu tier's: a contract names no tier of its own for it.
        if "gpu" not in contract_tiers(contract) or "deepspeed" not in selected or \
                not any(s in SHARDED_STRATEGIES for s in contract.strategies):
            return []
        return [Variant(self.name, "deepspeed", "deepspeed-gpu", (self.gpu_marker, self.marker()),
                        (self.name, "gpu"))]


def deepspeed_not_found() -> str | None:
    """Why DeepSpeed cannot run, when this process cannot even find it (no import is made)."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed not importable (no module named 'deepspeed'; pip install 'deepspeed>=0.16')"
    return None


def not_importable(why: str) -> str:
    """The reason DeepSpeed's tier does not run, from ``why`` its import failed
    (``"ExceptionType: message"``; its first line is kept)."""
    return f"deepspeed not importable ({why.splitlines()[0] if why else ''})"


def deepspeed_missing() -> str | None:
    """Why DeepSpeed cannot run here (not found, or its import raises), or None; imports it."""
    if not_found := deepspeed_not_found():
        return not_found
    try:
        with quiet_deepspeed_detection():
            importlib.import_module("deepspeed")
    except Exception as exc:  # a broken build raises all sorts of things at import
        return not_importable(f"{type(exc).__name__}: {exc}")
    return None


@contextlib.contextmanager
def quiet_deepspeed_detection():
    """Without a CUDA device DeepSpeed's import picks its CPU accelerator and warns that it did,
    before pytest's header; naming CPU for the import picks the same one without the warning.
    The variable is removed again, so the user's own tests see the environment they set. Used
    around the imports of this process: the availability check and the user's modules."""
    if "DS_ACCELERATOR" in os.environ or cuda_device_count() > 0:
        yield
        return
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        yield
    finally:
        os.environ.pop("DS_ACCELERATOR", None)
