"""The pytest-side run interface: which runs a contract is judged on and the probe it observes
them with, as pure data apart from the rank-side harness that makes them (``harness.py``).

A :class:`RunSpec` names its rank-side functions as "module:function" strings, resolved on the
ranks; the session passes the spec object itself, never its name to be looked up again. Imports
nothing of the plugin, no torch and no Lightning.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A run a contract is judged on. ``name`` keys the session's run cache (contracts that
    declare the same spec share one run) and labels the run in verdicts. ``fn`` ("module:function")
    runs on every rank as ``fn(ctx, targets, strategy_name, probes, pg_timeout_s) -> dict``, where
    ``probes`` is ``[(contract_id, "module:Class"), ...]``. ``reference`` ("module:function" or
    None) runs on one rank after a finished world, as ``reference(ctx, targets, *args,
    pg_timeout_s)`` with ``args`` = rank 0's ``value["reference_args"]``. ``trains``: whether the
    run trains (False for an inspection run, which loads the user's objects only and so cannot run
    into a hang of an earlier training run)."""

    name: str
    fn: str
    reference: str | None = None
    trains: bool = True


FIT = RunSpec("fit", "pytest_ltconform.harness:traced_fit")
# The same fit with validation and its sanity check switched off: what the fit-based contracts are
# judged on when the shared fit stopped in validation because of another contract's failure.
FIT_WITHOUT_VALIDATION = RunSpec("fit-without-validation", "pytest_ltconform.harness:traced_fit_without_validation")
WITHOUT_VALIDATION = {"limit_val_batches": 0, "num_sanity_val_steps": 0}


def inspection(name: str) -> RunSpec:
    """A run that loads the user's objects without training; each probe's :meth:`Probe.inspect`
    says what it observed. One per contract (``name``), so a failing probe stays its own."""
    return RunSpec(name, "pytest_ltconform.harness:inspect", trains=False)


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
