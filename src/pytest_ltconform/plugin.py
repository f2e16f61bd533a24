"""pytest glue: options, markers, item generation, fixtures, report hooks, terminal summary.

Thin by design: no torch logic lives here, and nothing heavy is imported unless
``--ltconform`` (or its ini twin, or an ``ltconform_*`` fixture) is in use, so a plain ``pytest``
run in a repository that has this plugin installed costs what it cost before.
"""

from __future__ import annotations

import json
import os

import pytest

from . import settings as settings_mod

SESSION_KEY = pytest.StashKey["object"]()
SETTINGS_KEY = pytest.StashKey["settings_mod.Settings"]()
POOL_KEY = pytest.StashKey["object"]()
ONLY_CONTRACTS_KEY = pytest.StashKey[bool]()

MARKERS = {
    "ltconform": "a generated pytest-ltconform contract item",
    "ltconform_cpu": "runs on CPU gloo ranks (every machine)",
    "ltconform_gpu": "needs at least 2 CUDA devices and NCCL",
    "ltconform_multinode": "needs an existing world that spans several nodes (torchrun, SLURM)",
    "ltconform_deepspeed": "needs deepspeed importable and CUDA",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    settings_mod.add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    settings = settings_mod.resolve(config)
    config.stash[SETTINGS_KEY] = settings
    config.pluginmanager.register(ResultsCollector(config), "ltconform-results")
    if not settings.enabled:
        return
    from . import target as target_mod

    try:
        targets = target_mod.validate(settings.target, settings.datamodule, settings.trainer)
    except target_mod.TargetError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[SESSION_KEY] = targets
    # `pytest --ltconform X` with no test paths runs the contracts alone; with paths given, or
    # with the target in the ini file, the contract items join the normal test run.
    from_command_line = config.getoption(settings_mod.OPT_TARGET) not in (None, "")
    config.stash[ONLY_CONTRACTS_KEY] = from_command_line and config.args_source != pytest.Config.ArgsSource.ARGS


def pytest_ignore_collect(collection_path, config):
    if config.stash.get(ONLY_CONTRACTS_KEY, False):
        return True
    return None


def _session(config: pytest.Config):
    """The LtconformSession, created on first use (so --collect-only starts nothing)."""
    obj = config.stash.get(SESSION_KEY, None)
    if obj is None:
        return None
    from .session import LtconformSession

    if not isinstance(obj, LtconformSession):
        obj = LtconformSession(config.stash[SETTINGS_KEY], obj, pool=_pool(config))
        config.stash[SESSION_KEY] = obj
    return obj


def _pool(config: pytest.Config):
    pool = config.stash.get(POOL_KEY, None)
    if pool is None:
        from .world import WorldPool

        pool = WorldPool()
        config.stash[POOL_KEY] = pool
    return pool


def pytest_unconfigure(config: pytest.Config) -> None:
    pool = config.stash.get(POOL_KEY, None)
    if pool is not None:
        pool.close()


class ContractFailed(Exception):
    """Raised by an item whose contract failed; carries the verdict."""

    def __init__(self, verdict_dict: dict):
        super().__init__(verdict_dict["summary"])
        self.verdict = verdict_dict


class NotJudged(Exception):
    """Raised in setup when the run needed by an item could not be judged (reported as error)."""

    def __init__(self, verdict_dict: dict):
        super().__init__(verdict_dict["summary"])
        self.verdict = verdict_dict


class LtconformItem(pytest.Item):
    """One (contract, strategy) check on the session's target."""

    def __init__(self, *, contract_id: str, strategy: str, **kwargs):
        super().__init__(**kwargs)
        self.contract_id = contract_id
        self.strategy = strategy
        self.verdict_dict: dict | None = None

    def setup(self) -> None:
        session = _session(self.config)
        verdict, duration = session.verdict(self.contract_id, self.strategy)
        from . import report

        self.verdict_dict = verdict.as_dict()
        rec = report.record(self.contract_id, self.strategy, session.settings.world_size,
                            self.verdict_dict, duration)
        self.user_properties.append((report.PROPERTY, json.dumps(rec)))
        if verdict.outcome == "skipped":
            pytest.skip(verdict.summary)
        if verdict.outcome == "error":
            raise NotJudged(self.verdict_dict)

    def runtest(self) -> None:
        if self.verdict_dict and self.verdict_dict["outcome"] in ("failed", "advisory"):
            raise ContractFailed(self.verdict_dict)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, (ContractFailed, NotJudged)):
            return excinfo.value.verdict["message"]
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.path, None, f"ltconform {self.name}"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    # tryfirst: our items must exist before -k / -m deselection runs.
    targets = config.stash.get(SESSION_KEY, None)
    if targets is None:
        return
    from . import contracts
    from .session import SUPPORTED_STRATEGIES

    settings = config.stash[SETTINGS_KEY]
    parent = session
    for cid in contracts.ids():
        contract = contracts.get_contract(cid)
        for strategy in contract.strategies:
            if strategy not in settings.strategies or strategy not in SUPPORTED_STRATEGIES:
                continue
            item = LtconformItem.from_parent(
                parent, name=f"{cid}[{strategy}]", nodeid=f"ltconform::{cid}[{strategy}]",
                contract_id=cid, strategy=strategy,
            )
            item.add_marker("ltconform")
            item.add_marker("ltconform_cpu")
            items.append(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if isinstance(item, LtconformItem) and call.excinfo is not None and \
            isinstance(call.excinfo.value, (ContractFailed, NotJudged)):
        # Setup errors would otherwise render a traceback of our own code.
        report.longrepr = call.excinfo.value.verdict["message"]
    return report


def pytest_report_teststatus(report, config):
    if report.when == "call" and report.failed:
        from . import report as report_mod

        rec = report_mod.from_report(report)
        if rec and rec["outcome"] == "advisory":
            return "failed", "A", ("ADVISORY", {"yellow": True})
    return None


class ResultsCollector:
    """Collects every ltconform record from the reports (also those xdist workers send back),
    prints the summary table and writes the JSON report."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.results: list[dict] = []

    def pytest_runtest_logreport(self, report) -> None:
        from . import report as report_mod

        rec = report_mod.from_report(report)
        # One record per item: the call phase, or the setup phase when setup did not pass.
        if rec is not None and (report.when == "call" or (report.when == "setup" and not report.passed)):
            self.results.append(rec)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.results:
            return
        from . import report as report_mod

        tw = terminalreporter._tw
        width = min(getattr(tw, "fullwidth", 100), 100)
        terminalreporter.write_sep("=", "ltconform summary", bold=True)
        text = report_mod.summary_text(self.results, width=width, color=tw.hasmarkup)
        for line in text.splitlines():
            terminalreporter.write_line(line)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        settings = self.config.stash.get(SETTINGS_KEY, None)
        if settings is None or not settings.report or hasattr(self.config, "workerinput"):
            return
        from . import report as report_mod

        os.makedirs(os.path.dirname(settings.report) or ".", exist_ok=True)
        report_mod.write_json(settings.report, settings.target, settings.world_size, list(self.results))


# -- fixtures ------------------------------------------------------------------------------------

class WorldHandle:
    """What ``ltconform_world(...)`` returns: ``run(fn, *args)`` on every rank."""

    def __init__(self, pool, world_size: int, timeout_s: float, pg_timeout_s: float):
        self._pool = pool
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.pg_timeout_s = pg_timeout_s

    def run(self, fn, *args, timeout_s: float | None = None) -> list:
        """Run ``fn(ctx, *args)`` on every rank; ``fn`` must be importable (module level).

        Returns the per-rank return values in rank order. Fails the test with every failed
        rank's traceback (rank-tagged) and the hang diagnosis when any rank raises, dies or hangs.
        """
        ref = fn if isinstance(fn, str) else f"{fn.__module__}:{fn.__qualname__}"
        if not isinstance(fn, str) and "<locals>" in fn.__qualname__:
            raise pytest.UsageError(f"ltconform_world.run: {fn.__qualname__} is a local function; ranks import "
                                    f"the function by name, so define it at module level.")
        result = self._pool.run(self.world_size, ref, *args, timeout_s=timeout_s or self.timeout_s,
                                pg_timeout_s=self.pg_timeout_s)
        if result.status == "skip":
            pytest.skip(result.ranks[0].message or "skipped inside the ranks")
        if result.status != "ok":
            pytest.fail(f"ltconform_world.run({ref}) failed on {result.world_size} ranks:\n"
                        f"{result.failure_text()}", pytrace=False)
        return result.values


@pytest.fixture
def ltconform_world(request):
    """Factory fixture: ``ltconform_world(world_size=2).run(fn, *args)`` -> per-rank results.

    Worlds are persistent for the session (one cold start per world size); a world whose job
    failed is replaced on the next call.
    """
    config = request.config
    settings = config.stash.get(SETTINGS_KEY, None) or settings_mod.Settings(target=None)

    def make(world_size: int = settings.world_size, timeout_s: float | None = None) -> WorldHandle:
        timeout = timeout_s or settings.timeout_s
        return WorldHandle(_pool(config), world_size, timeout, max(5.0, min(timeout / 4.0, 60.0)))

    return make


@pytest.fixture
def ltconform_target(request):
    """The validated targets of this session (skips when no --ltconform target is set)."""
    targets = request.config.stash.get(SESSION_KEY, None)
    if targets is None:
        pytest.skip("no --ltconform target given")
    return getattr(targets, "targets", targets)
