"""Shared paths and helpers for the plugin's own tests."""

from __future__ import annotations

import contextlib
import inspect
import os
import pathlib
import re
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFORMANCE = REPO / "conformance"
BORING = "lightning.pytorch.demos.boring_classes.BoringModel"


def case(path: str) -> str:
    """Absolute ``file.py:Model`` target of a corpus case."""
    return f"{CONFORMANCE / path}:Model"


def rank_pids(supervisor_pid: int | None = None, cwd_marker: str | None = None, parents: bool = False) -> list[int]:
    """Live rank processes, optionally only those of one supervisor, or of supervisors started in a
    directory under ``cwd_marker`` (a rank's PYTHONPATH carries its supervisor's working directory);
    with ``parents``, the fork launcher's parents and the store keepers they fork too (a forked
    rank is told from its parent by that: the parent's parent is the supervisor; from a keeper by
    the keeper's process name)."""
    from pytest_ltconform.world.protocol import SUPERVISOR_PID_ENV

    supervisor_key = SUPERVISOR_PID_ENV.encode()  # every rank's environment names its supervisor
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = dict(item.split(b"=", 1) for item in fh.read().split(b"\0") if b"=" in item)
            with open(f"/proc/{entry}/stat", "rb") as fh:
                state = fh.read().split(b")")[-1].split()[0]
        except OSError:
            continue
        if state == b"Z" or supervisor_key not in env:
            continue
        if supervisor_pid is not None and int(env[supervisor_key]) != supervisor_pid:
            continue
        if cwd_marker is not None and cwd_marker.encode() not in env.get(b"PYTHONPATH", b""):
            continue
        if not parents and _is_fork_parent(int(entry), int(env[supervisor_key])):
            continue
        found.append(int(entry))
    return found


def _is_fork_parent(pid: int, supervisor_pid: int) -> bool:
    """A fork launcher's parent or a store keeper it forked: not a rank."""
    from pytest_ltconform.world.zygote import KEEPER_NAME

    try:
        with open(f"/proc/{pid}/comm", "rb") as fh:
            if fh.read().strip() == KEEPER_NAME.encode():
                return True
        with open(f"/proc/{pid}/stat", "rb") as fh:
            ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return b"world.zygote" in fh.read() and ppid == supervisor_pid
    except (OSError, ValueError, IndexError):
        return False


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.fixture
def no_leftover_ranks(pytester):
    """Fails the test if rank processes its pytest subprocesses started, or their fork parents and
    store keepers, are still alive afterwards."""
    yield
    marker = str(pytester.path)
    assert wait_until(lambda: not rank_pids(cwd_marker=marker, parents=True), 15), \
        f"rank processes left behind: {rank_pids(cwd_marker=marker, parents=True)}"


# -- fake runs: the Run a contract judges, from hand-made per-rank data (no world started) --------

class FakeRuns:
    """Builds runs with the world's own result types, so verdict tests judge what a real job returns."""

    @staticmethod
    def rank(rank: int, trace=(), value=None, status: str = "ok", **outcome):
        """One rank's outcome: its trace events, its returned value, and for a failed rank
        ``exc_type``, ``message``, ``traceback``."""
        from pytest_ltconform.world import RankOutcome

        return RankOutcome(rank=rank, status=status, value=value, trace=list(trace), **outcome)

    @staticmethod
    def job(ranks: list, status: str = "ok", divergence: dict | None = None):
        from pytest_ltconform.world import JobResult

        return JobResult(status=status, ranks=ranks, duration_s=0.1, world_size=len(ranks), divergence=divergence)

    def of(self, ranks: list, status: str = "ok", kind: str = "fit", reference=None, **job):
        """A ddp run of ``kind`` made of ``ranks`` (from :meth:`rank`); ``reference`` (a run, e.g. the
        one-device run a contract compares against) is attached as ``run.reference`` when given."""
        from pytest_ltconform.contracts.base import Run

        run = Run(self.job(ranks, status, **job), "ddp", kind)
        if reference is not None:
            run.reference = reference
        return run

    def run(self, traces: list | None = None, values: list | None = None, **job):
        """A ddp run (a fit unless ``kind`` says otherwise) with one rank per entry of ``traces``
        (event lists) or ``values`` (returned dicts); ``job`` as for :meth:`of`."""
        n = len(traces or values)
        traces, values = traces or [[]] * n, values or [None] * n
        return self.of([self.rank(r, traces[r], values[r]) for r in range(n)], **job)

    def failed(self, traces: list, status: str = "error", messages: dict | None = None, **job):
        """A ddp run whose every rank stopped with ``status``, rank r with ``traces[r]`` and the error
        message ``messages[r]`` (None when absent)."""
        ranks = [self.rank(r, trace, status=status, message=(messages or {}).get(r)) for r, trace in enumerate(traces)]
        return self.of(ranks, status=status, **job)

    def probed(self, contract_id: str, observations: list, **job):
        """A ddp run in which rank r returned ``observations[r]`` as its probe data for ``contract_id``."""
        return self.run(values=[{"probes": {contract_id: o}} for o in observations], **job)

    @staticmethod
    def batches(rank_rows: list[list[str]], epoch: int = 0) -> list[dict]:
        """data-sharding's ``batch`` events for one rank: one batch per list of sample-row hashes."""
        return [{"ev": "batch", "stage": "train", "idx": i, "dl": 0, "epoch": epoch, "n": len(rows),
                 "fp": "|".join(rows), "rows": rows} for i, rows in enumerate(rank_rows)]


@pytest.fixture
def fake_runs() -> FakeRuns:
    """The shared builder of hand-made runs for verdict tests (see :class:`FakeRuns`)."""
    return FakeRuns()


@pytest.fixture(autouse=True)
def _forget_modules_of_temporary_files(tmp_path_factory):
    """A module a test imported from its temporary folder (``targets_mod`` and friends) is dropped
    afterwards, so that a later test's file of the same name is imported afresh, not found cached."""
    before = set(sys.modules)
    yield
    base = str(tmp_path_factory.getbasetemp())
    for name in set(sys.modules) - before:
        if (getattr(sys.modules.get(name), "__file__", None) or "").startswith(base):
            del sys.modules[name]


# -- the `world` marker: tests that start rank processes -------------------------------------------

# What starts worlds: a pytest subprocess (the usual way), a world or pool made here, another process,
# the corpus command; an in-process pytest run checking a module; the fixture that runs on ranks.
_WORLD_CALLS = re.compile(r"runpytest_subprocess|LocalWorld\(|WorldPool\(|popen\(|subprocess\.(run|Popen)\("
                          r"|pytest_ltconform\.corpus|judge_items|runpytest\([^)]*(BORING|case\()")
_WORLD_FIXTURES = {"ltconform_world", "no_leftover_ranks"}


def _world_names(module) -> set[str]:
    """The module's functions (fixtures and helpers included) that start worlds, directly or through
    another of them."""
    sources = {}
    for name, obj in vars(module).items():
        fn = getattr(obj, "__wrapped__", obj)
        if inspect.isfunction(fn) and fn.__module__ == module.__name__:
            with contextlib.suppress(OSError, TypeError):
                sources[name] = inspect.getsource(fn)
    names = {n for n, src in sources.items() if _WORLD_CALLS.search(src)}
    while True:  # helpers that call helpers
        more = {n for n, src in sources.items() if n not in names and any(re.search(rf"\b{m}\b", src) for m in names)}
        if not more:
            return names
        names |= more


def pytest_collection_modifyitems(config, items):
    """Mark ``world`` every test that starts rank processes, so ``-m "not world"`` is the quick inner
    loop; the marker deselects nothing by default."""
    by_module: dict = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        if module not in by_module:
            by_module[module] = _world_names(module)
        names = by_module[module] | _WORLD_FIXTURES
        tiers = {"slow", "multinode", "gpu"} & {m.name for m in item.iter_markers()}  # all start processes
        if tiers or item.originalname in names or names & set(item.fixturenames):
            item.add_marker(pytest.mark.world)


# -- the order the default run's workers take modules in ---------------------------------------------

# The modules that cost the most (measured: CPU seconds of a default run), dealt out first so that
# none of them is left to run alone at the end; the rest follow by their number of tests (xdist's own
# order). Only an order: a module missing here is still run.
_COSTLY_FIRST = ("test_worlds.py", "test_startup.py", "test_launch.py", "test_deepspeed.py", "test_memory.py",
                 "test_sharded.py", "test_report.py", "test_first_run.py", "test_targets.py", "test_tiers.py",
                 "test_world_formation.py", "test_hangs.py", "test_plugin_items.py", "test_spawn_safety.py")
_COST_RANK = {name: n for n, name in enumerate(_COSTLY_FIRST)}
_CORPUS_PART = "test_corpus.py::TestCorpusPart"


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope``, with at most (workers - 1) corpus parts judged at once. A part spends
    much of its wall time waiting out the hangs its cases provoke, with its CPU idle: started
    together (xdist deals the largest scopes first), the parts left the machine half idle for a
    third of the run. The other workers meanwhile take the costly modules first."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class CorpusApart(LoadScopeScheduling):
        def _assign_work_unit(self, node):
            busy = sum(1 for other, work in self.assigned_work.items() if other is not node
                       for scope, tests in work.items() if _CORPUS_PART in scope and not all(tests.values()))
            parts = [s for s in self.workqueue if _CORPUS_PART in s]
            others = sorted((s for s in self.workqueue if _CORPUS_PART not in s),
                            key=lambda s: _COST_RANK.get(s.rsplit("/", 1)[-1].split("::")[0], len(_COST_RANK)))
            part_allowed = busy < max(1, len(self.nodes) - 1) or not others
            pick = parts[0] if parts and part_allowed else others[0]
            self.workqueue.move_to_end(pick, last=False)
            super()._assign_work_unit(node)

    return CorpusApart(config, log)
