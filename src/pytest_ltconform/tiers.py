"""Tiers: which worlds a contract item runs in, what each tier needs, and how to tell that
pytest itself is one rank of a world that torchrun or SLURM started.

Every generated item is one (contract, variant). A variant names the tier, the strategy and the
world parameters; the rank-side code path is the same for all of them, only the world differs:

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
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import warnings

from .vocabulary import CPU_CORE_STRATEGIES, DEFAULT_CONTRACT_TIERS, GPU_STRATEGIES, SHARDED_STRATEGIES, backend_for
from .world.devices import cuda_device_count


@dataclasses.dataclass(frozen=True)
class Variant:
    """One world an item runs in.

    ``label`` is the item parameter (``all-rank-save[ddp-gpu]``); ``markers`` the pytest markers
    besides ``ltconform``; ``needs`` the tiers whose availability is checked, in order, before
    the item runs (the first missing one names the skip reason).
    """

    tier: str
    strategy: str
    label: str
    markers: tuple[str, ...]
    needs: tuple[str, ...]

    @property
    def backend(self) -> str:
        return backend_for(self.tier)


def contract_tiers(contract) -> tuple[str, ...]:
    """The tiers a contract has items in: its ``tiers`` attribute, else cpu, gpu and multinode."""
    return tuple(getattr(contract, "tiers", None) or DEFAULT_CONTRACT_TIERS)


def variants(contract, selected: tuple[str, ...], local_supported: tuple[str, ...]) -> list[Variant]:
    """Every variant of ``contract``, in item order: CPU first, then GPU, DeepSpeed, multi-node.

    ``selected`` are the strategies the user asked for (``--ltconform-strategies``);
    ``local_supported`` the strategies the CPU tier can run today.
    """
    tiers = contract_tiers(contract)
    own = tuple(contract.strategies)
    out: list[Variant] = []
    if "cpu" in tiers:
        out += [_cpu_variant(s) for s in own if s in selected and s in local_supported]
    if "gpu" in tiers:
        gpu = [s for s in own if s in GPU_STRATEGIES and s != "deepspeed"]
        out += [Variant("gpu", s, f"{s}-gpu", ("ltconform_gpu",), ("gpu",)) for s in gpu if s in selected]
        if any(s in SHARDED_STRATEGIES for s in own) and "deepspeed" in selected:
            out.append(Variant("deepspeed", "deepspeed", "deepspeed-gpu", ("ltconform_gpu", "ltconform_deepspeed"),
                               ("deepspeed", "gpu")))
    if "multinode" in tiers:
        out += [Variant("multinode", s, f"{s}-multinode", ("ltconform_multinode",), ("multinode",))
                for s in own if s in selected and s in local_supported and s in CPU_CORE_STRATEGIES]
    return out


def _cpu_variant(strategy: str) -> Variant:
    if strategy == "deepspeed":  # real DeepSpeed on gloo ranks: needs the package, not a GPU
        return Variant("cpu", strategy, strategy, ("ltconform_cpu", "ltconform_deepspeed"), ("cpu", "deepspeed"))
    return Variant("cpu", strategy, strategy, ("ltconform_cpu",), ("cpu",))


# -- attached worlds -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Attached:
    """This pytest process is rank ``rank`` of a world of ``world_size`` ranks that ``launcher``
    ('torchrun' or 'slurm') started. Values are read through Lightning's own ClusterEnvironment
    classes, so they are the ones a Trainer in this process would use."""

    launcher: str
    environment: str
    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    main_address: str
    main_port: int
    agent_store: bool

    def describe(self) -> str:
        return f"rank {self.rank} of a {self.launcher} world of {self.world_size} ranks"


def detect_attached(environ=None) -> Attached | None:
    """The launched world this process belongs to, or None (no launcher, or a world of one rank).

    Tried in Lightning's own order: TorchElasticEnvironment (torchrun), then SLURMEnvironment
    (srun; a job named 'bash' or 'interactive' is an interactive shell, not a launch).
    """
    environ = os.environ if environ is None else environ
    if not any(k in environ for k in ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS")):
        return None  # the common case costs no lightning import
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    with warnings.catch_warnings():  # detect() warns about srun on PATH; the Trainer says it if it matters
        warnings.simplefilter("ignore")
        in_slurm = SLURMEnvironment.detect()
    if TorchElasticEnvironment.detect():
        env, launcher = TorchElasticEnvironment(), "torchrun"
    elif in_slurm:
        # Without __init__: it raises on layouts such as `srun -n 2` (no --ntasks-per-node), which
        # the launch-env contract should report in that world instead of every rank dying here.
        env, launcher = object.__new__(SLURMEnvironment), "slurm"
    else:
        return None
    world_size = env.world_size()
    if world_size < 2:
        return None
    return Attached(
        launcher=launcher, environment=type(env).__name__, rank=env.global_rank(), world_size=world_size,
        local_rank=env.local_rank(), node_rank=env.node_rank(), main_address=env.main_address,
        main_port=env.main_port, agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )


# -- availability ---------------------------------------------------------------------------------

def _deepspeed_missing() -> str | None:
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed not importable (no module named 'deepspeed'; pip install 'pytest-ltconform[deepspeed]')"
    try:
        importlib.import_module("deepspeed")
    except Exception as exc:  # a broken build raises all sorts of things at import
        return f"deepspeed not importable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return None


class Availability:
    """Answers "can this tier run here, and if not, why not" once per session per tier.

    ``attached`` is the launched world pytest runs in (None when local); ``num_nodes`` the
    number of nodes that world spans, as agreed by every rank at collection time.
    """

    def __init__(self, world_size: int, attached: Attached | None = None, num_nodes: int | None = None,
                 cuda_count=cuda_device_count, deepspeed_missing=_deepspeed_missing):
        self.world_size = world_size
        self.attached = attached
        self.num_nodes = num_nodes
        self._cuda_count = cuda_count
        self._deepspeed_missing = deepspeed_missing
        self._cache: dict[str, str | None] = {}

    def missing(self, tier: str) -> str | None:
        """None when ``tier`` can run here, else the reason naming what is missing."""
        if tier not in self._cache:
            self._cache[tier] = self._check(tier)
        return self._cache[tier]

    def _check(self, tier: str) -> str | None:
        a = self.attached
        if tier == "multinode":
            if a is None:
                return ("not inside a multi-node world: no torchrun or SLURM launch found in this pytest "
                        "process (run pytest under `torchrun --nnodes N ...` or `srun -N N ...`; see docs/ci.md)")
            nodes = self.num_nodes or 1
            if nodes < 2:
                return (f"not inside a multi-node world: pytest is {a.describe()}, all on "
                        f"{nodes} node; the multinode tier needs 2 or more nodes")
            return None
        if a is not None:
            # Ranks of a launched world must not start worlds of their own.
            return (f"pytest is {a.describe()}: the {tier} tier starts local ranks, which the plugin never "
                    f"does inside a launched world; run this tier without torchrun/srun, or select "
                    f"-m ltconform_multinode here")
        if tier == "cpu":
            return None
        if tier == "deepspeed":
            return self._deepspeed_missing()
        if tier == "gpu":
            found = self._cuda_count()
            if found < self.world_size:
                return f"needs {self.world_size} CUDA devices, found {found}"
            return None
        raise ValueError(f"unknown tier {tier!r}")

    def first_missing(self, variant: Variant) -> tuple[str, str] | None:
        """(tier, reason) for the first tier ``variant`` needs that is missing, else None."""
        for tier in variant.needs:
            reason = self.missing(tier)
            if reason:
                return tier, reason
        return None
