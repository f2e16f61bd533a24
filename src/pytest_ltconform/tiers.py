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

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import re
import warnings

from .vocabulary import (
    CPU_CORE_STRATEGIES,
    DEFAULT_CONTRACT_TIERS,
    GPU_STRATEGIES,
    SHARDED_STRATEGIES,
    backend_for,
    rank_env_for,
)
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


def world_for(tier: str, pool, attached, world_size: int, pg_timeout_s: float):
    """The ``world.World`` a run of ``tier`` goes to, decided here only: the launched world pytest
    runs in for 'multinode' (``WorldStartError`` outside one), else the pool's local world of
    ``world_size`` ranks with the tier's backend and rank environment."""
    from .world import WorldStartError

    if tier == "multinode":
        if attached is None:
            raise WorldStartError("the multinode tier runs only inside a torchrun or SLURM world")
        return attached
    return pool.get(world_size, backend_for(tier), pg_timeout_s, rank_env_for(tier))


def reference_world(tier: str, pool, pg_timeout_s: float):
    """The one-rank CPU world beside ``tier``'s world where a reference run (``RunSpec.reference``)
    goes; None in a launched world, where every rank runs every job and the plugin starts none."""
    if tier == "multinode":
        return None
    return pool.get(1, backend_for("cpu"), pg_timeout_s, rank_env_for("cpu"))


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


class Availability:
    """Answers "can this tier run here, and if not, why not" once per session per tier.

    ``attached`` is the launched world pytest runs in (None when local); ``num_nodes`` the
    number of nodes that world spans, as agreed by every rank at collection time.
    """

    def __init__(self, world_size: int, attached: Attached | None = None, num_nodes: int | None = None,
                 cuda_count=cuda_device_count, deepspeed_missing=deepspeed_missing):
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


# -- which items exist --------------------------------------------------------------------------

# The pytest marker of each tier, and how to run a tier this machine cannot (the header's hint).
TIER_MARKERS = {"cpu": "ltconform_cpu", "gpu": "ltconform_gpu", "multinode": "ltconform_multinode",
                "deepspeed": "ltconform_deepspeed"}
ENABLE_HINTS = {
    "cpu": "run it without torchrun/srun; docs/ci.md",
    "gpu": "on a GPU runner: -m ltconform_gpu; docs/ci.md",
    "multinode": "under torchrun or srun across nodes: -m ltconform_multinode; docs/ci.md",
    "deepspeed": "once installed, the [deepspeed] items run; docs/ci.md",
}

# A -m token: parentheses, an identifier as pytest spells marker names (letters, digits,
# _ : + - . [ ] \ /) with its keyword arguments if any, or anything else (an error).
_MARK_TOKEN = re.compile(r"\s*(?:(\()|(\))|([\w:+\-.\[\]\\/]+)(\s*\([^)]*\))?|(\S))")


class MarkExpression:
    """A ``-m`` expression, parsed here (pytest's parser is private): ``and``, ``or``, ``not``,
    parentheses, marker names, and ``name(...)`` keyword matches (which no generated item carries).

    :meth:`matches` says whether an item with the given marker names is selected; :meth:`names`
    whether a marker is named without being negated. ``parse`` raises ``ValueError`` for text that
    is not an expression (pytest then reports it itself).
    """

    def __init__(self, tree):
        self._tree = tree  # ("name", str) | ("call", str) | ("not", t) | ("and" | "or", t, t) | ("all",)

    @classmethod
    def parse(cls, text: str | None) -> MarkExpression:
        tokens = cls._tokens(text or "")
        if not tokens:
            return cls(("all",))
        tree, end = cls._or(tokens, 0)
        if end != len(tokens):
            raise ValueError(f"unexpected {tokens[end][1]!r} in -m {text!r}")
        return cls(tree)

    @staticmethod
    def _tokens(text: str) -> list[tuple[str, str]]:
        out, pos = [], 0
        while True:
            m = _MARK_TOKEN.match(text, pos)
            if m is None:
                return out  # only white space is left
            if m.group(5) is not None:
                raise ValueError(f"unexpected {m.group(5)!r} in -m {text!r}")
            kind, pos = ("(" if m.group(1) else ")" if m.group(2) else m.group(3)), m.end()
            if kind in ("and", "or", "not"):
                out.append(("op", kind))
                pos = m.end(3)  # "not (a)" is an operator, not a keyword match on a marker named "not"
            elif kind in ("(", ")"):
                out.append(("op", kind))
            else:
                out.append(("call" if m.group(4) else "id", kind))

    @classmethod
    def _or(cls, toks, i):
        return cls._chain("or", cls._and, toks, i)

    @classmethod
    def _and(cls, toks, i):
        return cls._chain("and", cls._not, toks, i)

    @staticmethod
    def _chain(op, operand, toks, i):
        """``operand (op operand)*``, folded to the left."""
        left, i = operand(toks, i)
        while i < len(toks) and toks[i] == ("op", op):
            right, i = operand(toks, i + 1)
            left = (op, left, right)
        return left, i

    @classmethod
    def _not(cls, toks, i):
        if i >= len(toks):
            raise ValueError("-m expression ends too early")
        if toks[i] == ("op", "not"):
            inner, i = cls._not(toks, i + 1)
            return ("not", inner), i
        if toks[i] == ("op", "("):
            inner, i = cls._or(toks, i + 1)
            if i >= len(toks) or toks[i] != ("op", ")"):
                raise ValueError("-m expression: missing ')'")
            return inner, i + 1
        if toks[i][0] == "op":
            raise ValueError(f"-m expression: unexpected {toks[i][1]!r}")
        return ("name" if toks[i][0] == "id" else "call", toks[i][1]), i + 1

    def matches(self, markers) -> bool:
        """Whether an item carrying the marker names ``markers`` (a set) is selected."""
        return self.evaluate(lambda name: name in markers)

    def matches_keywords(self, names) -> bool:
        """Read as a ``-k`` expression: whether an item with the names ``names`` (its name, extra
        keywords and markers) is selected; a name matches case-insensitively as a substring."""
        lowered = [n.lower() for n in names]
        return self.evaluate(lambda sub: any(sub.lower() in n for n in lowered))

    def evaluate(self, name_matches) -> bool:
        """The expression's value, with ``name_matches(name)`` deciding each bare name."""
        def ev(t) -> bool:
            op = t[0]
            if op == "all":
                return True
            if op == "name":
                return name_matches(t[1])
            if op == "call":
                return False  # generated items carry no marker arguments
            if op == "not":
                return not ev(t[1])
            return (ev(t[1]) and ev(t[2])) if op == "and" else (ev(t[1]) or ev(t[2]))
        return ev(self._tree)

    def names(self, marker: str) -> bool:
        """Whether ``marker`` appears in the expression under an even number of ``not``."""
        def walk(t, negated: bool) -> bool:
            if t[0] == "name":
                return t[1] == marker and not negated
            if t[0] == "not":
                return walk(t[1], not negated)
            return t[0] in ("and", "or") and (walk(t[1], negated) or walk(t[2], negated))
        return walk(self._tree, False)


def hidden_reason(variant: Variant, avail: Availability, require=(), markexpr: MarkExpression | None = None,
                  named_strategies=()) -> tuple[str, str] | None:
    """Whether the item of ``variant`` is left out of collection on this machine.

    Returns ``(tier, reason)``: a tier the variant needs cannot run here (``avail``) and the user
    neither requires it (``require``, the tiers of --ltconform-require: such an item is created and
    fails) nor asked for it (its marker named, not negated, in ``markexpr``; or, for a tier that is
    also a strategy, deepspeed, that strategy in ``named_strategies``, the ones given explicitly to
    --ltconform-strategies): such an item is created and skips with its reason. None: create the
    item (it can run, it is asked for or required, or ``markexpr`` deselects it anyway). Inside a
    launched world the multinode tier is decided later, once the ranks have agreed on the nodes.
    """
    if markexpr is not None and not markexpr.matches({"ltconform", *variant.markers}):
        return None  # pytest deselects it: nothing to hide
    missing = []
    for tier in variant.needs:
        if tier == "multinode" and avail.attached is not None and avail.num_nodes is None:
            continue
        reason = avail.missing(tier)
        if reason:
            missing.append((tier, reason))
    if any(tier in require for tier, _ in missing):
        return None
    for tier, reason in missing:
        asked = (markexpr is not None and markexpr.names(TIER_MARKERS[tier])) or \
            (tier == variant.strategy and tier in named_strategies)
        if not asked:
            return tier, reason
    return None


def not_run_line(tier: str, reason: str) -> str:
    """The report-header line for a tier whose items were left out: why, and how to run them."""
    hint = "" if "docs/ci.md" in reason else f" ({ENABLE_HINTS.get(tier, 'docs/ci.md')})"  # said once is enough
    return f"ltconform: {tier} tier not run: {reason}{hint}"
