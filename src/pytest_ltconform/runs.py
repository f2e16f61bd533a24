"""The pytest-side run interface: which runs a contract is judged on, what a run's job carries to
its ranks and the probe it observes them with, as pure data apart from the rank-side harness that
makes them (``harness.py``).

A :class:`RunSpec` names its rank-side functions as "module:function" strings, resolved on the
ranks; the session passes the spec object itself, never its name to be looked up again. A
:class:`RunArgs` is the one argument every such function gets after its rank context; a
:class:`RunKey` names one run. Imports nothing of the plugin but the world's layout (pure data),
no torch and no Lightning.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .world.layout import Layout


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A run a contract is judged on. ``name`` keys the session's run cache (contracts that
    declare the same spec share one run) and labels the run in verdicts. ``fn`` ("module:function")
    runs on every rank as ``fn(ctx, args) -> dict`` (``args`` a :class:`RunArgs`). ``reference``
    ("module:function" or None) runs on one rank after a finished world, as ``reference(ctx, args,
    *reference_args)``, where ``args`` is the run's :class:`RunArgs` for that one rank (no probes)
    and ``reference_args`` rank 0's ``value["reference_args"]``. ``trains``: whether the
    run trains (False for an inspection run, which loads the user's objects only and so cannot run
    into a hang of an earlier training run)."""

    name: str
    fn: str
    reference: str | None = None
    trains: bool = True
    # The run in words, as a report names it when it stops; and whether it is the plugin's own run
    # (a replay, a reference, an inspection: the user's config makes no such run, so its stop is a
    # reason not to judge, never a finding).
    what: str = ""
    own: bool = True

    def described(self) -> str:
        return self.what or f"the plugin's {self.name} run"


@dataclasses.dataclass(frozen=True)
class RunArgs:
    """What a run's job carries to every rank, as one value (pickled into the job): the
    ``target`` to load (a ``target.spec.ResolvedTarget``), the ``strategy`` the run is made under
    ('ddp', 'fsdp' or 'deepspeed'), the ``probes`` of the contracts judged on it (``((contract_id,
    "module:Class"), ...)``, loaded on the ranks), the process group's timeout ``pg_timeout_s``
    (seconds, for the strategies the ranks build) and the ``layout`` of the world it was asked
    for (nodes x ranks per node; None: the world's own, as an attached world's launcher made it).
    The rank context (``world.rank.RankContext``) says what the world gave: rank, world size,
    node count."""

    target: Any
    strategy: str
    probes: tuple[tuple[str, str], ...] = ()
    pg_timeout_s: float = 30.0
    layout: Layout | None = None

    def for_reference(self) -> RunArgs:
        """These arguments for a run's one-rank reference: no probes, one rank on one node."""
        return dataclasses.replace(self, probes=(), layout=Layout.single_node(1))


@dataclasses.dataclass(frozen=True)
class RunKey:
    """One run's identity: the ``target`` (its item id), the ``kind`` (a run spec's name), the
    ``strategy``, the ``tier`` and the world's ``layout`` (None: the attached world's own). Runs
    with equal keys are the same run: the session makes each once and shares it between the
    items judged on it."""

    target: str
    kind: str
    strategy: str
    tier: str
    layout: Layout | None


FIT = RunSpec("fit", "pytest_ltconform.harness:traced_fit", what="the traced fit of your Trainer config", own=False)
# The same fit with validation and its sanity check switched off: what the fit-based contracts are
# judged on when the shared fit stopped in validation because of another contract's failure.
FIT_WITHOUT_VALIDATION = RunSpec("fit-without-validation", "pytest_ltconform.harness:traced_fit_without_validation",
                                 what="the plugin's second fit, with validation switched off")
WITHOUT_VALIDATION = {"limit_val_batches": 0, "num_sanity_val_steps": 0}


def seeding_for(spec: RunSpec, seeding: str) -> str:
    """How a run of ``spec`` seeds its ranks under the session's ``seeding`` (vocabulary.SEEDINGS):
    the traced fits as the setting says ("both": each rank its own seed until training starts, one
    seed from then on, see harness.traced_fit). A run judged against a one-rank reference that
    draws its data anew (``spec.reference``: the evaluation) seeds every rank alike, so that the
    reference, seeded as rank 0, reproduces every rank's own draws; the other runs (a one-step run,
    an inspection) seed alike under "both" and as the setting says otherwise."""
    if spec in (FIT, FIT_WITHOUT_VALIDATION):
        return seeding
    return "same" if seeding == "both" or spec.reference else seeding


def inspection(name: str) -> RunSpec:
    """A run that loads the user's objects without training; each probe's :meth:`Probe.inspect`
    says what it observed. One per contract (``name``), so a failing probe stays its own."""
    return RunSpec(name, "pytest_ltconform.harness:inspect", trains=False,
                   what=f"the plugin's {name} inspection (it builds your objects without training)")


class Probe:
    """Rank-side observer of one run for one contract; every method is optional. ``objects`` is
    the run's ``harness.UserObjects``, ``recorder`` its ``trace.Recorder`` (None in an untraced
    run). Return values of :meth:`collect` and :meth:`inspect` must be plain data (pickled back)."""

    def install(self, recorder) -> None:
        """Patch what must be patched before the user's module is imported (taps on names the
        user imports, e.g. TorchMetrics functions)."""

    def before_trainer(self, objects, trainer_kwargs: dict, recorder) -> None:
        """Adjust the Trainer kwargs (e.g. add a callback) before the Trainer is built."""

    def before_fit(self, objects, trainer, recorder) -> None:
        """Inspect or hook the model and trainer before ``fit``."""

    def after_fit(self, objects, trainer, recorder) -> None:
        """Run more Trainer calls on the same world after ``fit`` (validate, test, predict)."""

    def collect(self, objects, trainer, recorder) -> Any:
        """Plain-data observations returned to the pytest side (``value["probes"][contract_id]``)."""
        return None

    def inspect(self, run) -> Any:
        """In an :func:`inspection` run: plain-data observations of ``run`` (a ``harness.RankRun``,
        no Trainer)."""
        return None
