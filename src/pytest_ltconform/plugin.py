"""pytest glue: options, markers, item generation, fixtures, report hooks, terminal summary.

Thin by design: no torch logic lives here, and nothing heavy is imported unless
``--ltconform`` (or its ini twin, or an ``ltconform_*`` fixture) is in use, so a plain ``pytest``
run in a repository that has this plugin installed costs what it cost before.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time

import pytest

from . import settings as settings_mod

TARGETS_KEY = pytest.StashKey["object"]()  # target.Targets of the first target, once validated
ALL_TARGETS_KEY = pytest.StashKey[dict]()  # target id -> target.Targets, every target in order
SESSIONS_KEY = pytest.StashKey[dict]()  # target id -> session.LtconformSession, created on first use
SETTINGS_KEY = pytest.StashKey["settings_mod.Settings"]()
POOL_KEY = pytest.StashKey["object"]()
ATTACHED_KEY = pytest.StashKey["object"]()
AVAILABILITY_KEY = pytest.StashKey["object"]()
ONLY_CONTRACTS_KEY = pytest.StashKey[bool]()
SIGTERM_KEY = pytest.StashKey["SigtermAsInterrupt"]()
HIDDEN_KEY = pytest.StashKey[dict]()
UNSELECTED_KEY = pytest.StashKey[str]()  # why the project's own targets add no item to this run
LIVE_OPEN_KEY = pytest.StashKey[bool]()  # a live progress line was written and not yet ended

# Live progress of a long contract run: a first line once it has run this long, then one line
# this often (seconds); LTCONFORM_PROGRESS_S overrides it, 0 turns the lines off.
PROGRESS_ENV = "LTCONFORM_PROGRESS_S"
PROGRESS_EVERY_S = 10.0

MARKERS = {
    "ltconform": "a generated pytest-ltconform contract item",
    "ltconform_cpu": "runs on CPU gloo ranks (every machine)",
    "ltconform_gpu": "needs at least 2 CUDA devices and NCCL",
    "ltconform_multinode": "needs an existing world that spans several nodes (torchrun, SLURM)",
    "ltconform_deepspeed": "runs real DeepSpeed ZeRO (CPU gloo ranks, or CUDA on the GPU tier); needs deepspeed "
                           "importable (pip install 'deepspeed>=0.16')",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    settings_mod.add_options(parser)


def pytest_addhooks(pluginmanager) -> None:
    from . import hooks

    pluginmanager.add_hookspecs(hooks)


def pytest_cmdline_main(config: pytest.Config) -> int | None:
    """``--ltconform-explain CONTRACT``: print the contract's rule page and exit, like ``--markers``
    (no target needed, nothing heavy imported)."""
    cid = config.getoption(settings_mod.OPT_EXPLAIN)
    if cid is None:
        return None
    from . import report as report_mod

    page = report_mod.contract_page(cid.strip())
    if page is None:
        sys.stderr.write(f"ERROR: --ltconform-explain: {report_mod.unknown_contract(cid)}\n")
        return pytest.ExitCode.USAGE_ERROR
    sys.stdout.write(page if page.endswith("\n") else page + "\n")
    return pytest.ExitCode.OK


@pytest.hookimpl(trylast=True)  # after the terminal reporter exists, so quiet ranks can drop it
def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    selected = _selects_project_contracts(config)
    settings = settings_mod.resolve(config, project_targets=selected)
    if not selected and config.args_source == pytest.Config.ArgsSource.ARGS and config.getini(settings_mod.INI_TARGET):
        # Paths named, contract items not deselected: say so, or a CI job running `pytest tests/` reads as checked.
        config.stash[UNSELECTED_KEY] = (
            f"ltconform: the {settings_mod.INI_TARGET} targets are not checked in this run: it names test paths "
            f"(run `pytest -m ltconform`, or pytest without paths, to check them)")
    config.stash[SETTINGS_KEY] = settings
    config.pluginmanager.register(ResultsCollector(config), "ltconform-results")
    config.pluginmanager.register(RunItems(), "ltconform-run-items")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and config.get_verbosity() >= 1:
        config.pluginmanager.register(PassedReasons(reporter), "ltconform-passed-reasons")
    if not settings.enabled:
        return
    from . import tiers

    if tiers.detect_attached() is None:  # a launched world is the launcher's to size and to stop
        if not hasattr(config, "workerinput"):
            settings_mod.check_capacity(settings)  # before anything heavy is imported or started
        _stop_on_sigterm(config)
    validated = _validate_targets(settings)
    config.stash[ALL_TARGETS_KEY] = validated
    config.stash[TARGETS_KEY] = next(iter(validated.values()))
    _attach(config, settings)
    # `pytest --ltconform X` with no test paths runs the contracts alone; with paths given, or
    # with the target in the ini file, the contract items join the normal test run.
    from_command_line = config.getoption(settings_mod.OPT_TARGET) not in (None, "")
    config.stash[ONLY_CONTRACTS_KEY] = from_command_line and config.args_source != pytest.Config.ArgsSource.ARGS


def _selects_project_contracts(config: pytest.Config) -> bool:
    """Whether this run selects the contract items of targets the project declares (ini list,
    ``pytest_ltconform_targets``): yes for a run that names no test path (``pytest``, ``pytest -k
    ...``) or whose ``-m`` names an ltconform marker; never when ``-m`` deselects every contract
    item. So ``pytest tests/test_x.py::test_y`` and ``pytest -m "not ltconform"`` cost what they
    cost without the plugin: no torch or Lightning import, no target validated, no item added."""
    from types import SimpleNamespace

    from . import tiers
    from .vocabulary import CPU_STRATEGIES, STRATEGIES

    try:
        markexpr = tiers.MarkExpression.parse(config.getoption("markexpr", ""))
    except ValueError:
        return True  # pytest reports a malformed -m itself
    every_tier = tiers.variants(SimpleNamespace(strategies=STRATEGIES, tiers=None), STRATEGIES, CPU_STRATEGIES)
    if not any(markexpr.matches({"ltconform", *variant.markers}) for variant in every_tier):
        return False
    return config.args_source != pytest.Config.ArgsSource.ARGS or any(markexpr.names(m) for m in MARKERS)


def _validate_targets(settings) -> dict:
    """Import and check every target (each one's own user modules forgotten before the next, so
    two folders with a ``model.py`` each do not meet); ``{id: target.Targets}`` in order. Raises
    ``pytest.UsageError`` naming the target (and which of the list) and the fix."""
    from . import target as target_mod
    from .tiers import quiet_deepspeed_detection

    validated = {}
    count = len(settings.targets)
    for n, declared in enumerate(settings.targets, 1):
        try:
            # A user module that imports deepspeed would otherwise print its accelerator warning.
            with target_mod.own_imports(), quiet_deepspeed_detection():
                validated[declared.id] = target_mod.validate(**settings_mod.validate_args(settings, declared))
        except target_mod.TargetError as exc:
            which = f"target {n} of {count} ({declared.id}): " if count > 1 else ""
            raise pytest.UsageError(f"{which}{exc}") from None
    return validated


def pytest_ignore_collect(collection_path, config):
    if config.stash.get(ONLY_CONTRACTS_KEY, False):
        return True
    return None


def _attach(config: pytest.Config, settings) -> None:
    """Inside a torchrun or SLURM world: spawn nothing, run the contracts in that world, and let
    only rank 0 print (every rank reaches the same verdicts)."""
    from . import tiers

    info = tiers.detect_attached()
    if info is None:
        return
    if config.getoption("numprocesses", None) or hasattr(config, "workerinput"):
        raise pytest.UsageError(
            f"pytest-ltconform: pytest is {info.describe()}; pytest-xdist workers (-n) cannot share one "
            f"rank of that world. Drop -n: the launcher already runs one pytest per rank.")
    from .world.attached import AttachedWorld

    config.stash[ATTACHED_KEY] = AttachedWorld(info, pg_timeout_s=settings.pg_timeout_s)
    if info.rank != 0:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


def _attached(config: pytest.Config):
    return config.stash.get(ATTACHED_KEY, None)


def _availability(config: pytest.Config):
    avail = config.stash.get(AVAILABILITY_KEY, None)
    if avail is None:
        from .tiers import Availability

        attached = _attached(config)
        avail = Availability(config.stash[SETTINGS_KEY].world_size, attached.info if attached else None,
                             attached.num_nodes if attached else None)
        config.stash[AVAILABILITY_KEY] = avail
    elif avail.num_nodes is None and _attached(config) is not None:
        avail.num_nodes = _attached(config).num_nodes  # agreed by every rank once collection finished
    return avail


def _variants(config: pytest.Config):
    """Every (contract id, contract, tiers.Variant) the session's strategies give, in item order."""
    from . import contracts, tiers
    from .vocabulary import CPU_STRATEGIES

    strategies = config.stash[SETTINGS_KEY].strategies
    for cid in contracts.ids():
        contract = contracts.get_contract(cid)
        for variant in tiers.variants(contract, strategies, CPU_STRATEGIES):
            yield cid, contract, variant


def _hidden(config: pytest.Config) -> dict:
    """{(contract id, variant label): (tier, reason)} of the items not created on this machine
    (see tiers.hidden_reason); decided once per session."""
    hidden = config.stash.get(HIDDEN_KEY, None)
    if hidden is None:
        from . import tiers

        settings = config.stash[SETTINGS_KEY]
        try:
            markexpr = tiers.MarkExpression.parse(config.getoption("markexpr", ""))
        except ValueError:
            markexpr = None  # pytest reports a malformed -m itself
        hidden = {}
        with _output_swallowed(config):  # importing deepspeed to check it prints a warning to stdout
            for cid, _contract, variant in _variants(config):
                why = tiers.hidden_reason(variant, _availability(config), settings.require, markexpr,
                                          settings.strategies_named)
                if why:
                    hidden[(cid, variant.label)] = why
        config.stash[HIDDEN_KEY] = hidden
    return hidden


@contextlib.contextmanager
def _output_swallowed(config: pytest.Config):
    """Capture and drop what is printed meanwhile; used outside test phases only, where pytest's
    global capture is suspended."""
    capman = config.pluginmanager.get_plugin("capturemanager")
    if capman is None or not capman.is_globally_capturing():
        yield
        return
    capman.resume_global_capture()
    try:
        yield
    finally:
        capman.suspend_global_capture()
        capman.read_global_capture()


def _not_run(config: pytest.Config) -> list[dict]:
    """The JSON report's ``not_run``: per tier whose items were not created here, the reason and how
    many items it would have had (one record each would bury the verdicts). Items that ``-k``
    would have deselected are not counted, as ``-m`` leaves out the tiers it deselects."""
    targets = config.stash.get(ALL_TARGETS_KEY, None)
    if targets is None:
        return []
    from . import tiers

    try:
        keyword = tiers.MarkExpression.parse(config.getoption("keyword", ""))
    except ValueError:
        keyword = tiers.MarkExpression.parse("")  # pytest reports a malformed -k itself
    hidden = _hidden(config)
    counts: dict = {}  # (tier, reason) -> items, in item order
    for tid, target in targets.items():
        for cid, contract, variant in _variants(config):
            why = hidden.get((cid, variant.label))
            # The names pytest's -k matches on a generated item: its name, the target's id, markers.
            names = (f"{cid}[{variant.label}]", tid, "ltconform", *variant.markers)
            if why and _applies(contract, variant.strategy, target) and keyword.matches_keywords(names):
                counts[why] = counts.get(why, 0) + 1
    return [{"tier": tier, "reason": reason, "items": n} for (tier, reason), n in counts.items()]


def _applies(contract, strategy: str, targets) -> bool:
    """Whether ``contract`` has an item under ``strategy`` for ``targets``: some strategies are
    judged only where the target's Trainer config names them (``Contract.configured_only``)."""
    return strategy not in contract.configured_only or targets.configures(strategy)


def _unavailable(reason: str) -> dict:
    """The verdict fields of an item whose tier cannot run here."""
    return {"outcome": "skipped", "message": reason, "summary": reason, "category": "unavailable"}


def _session(config: pytest.Config, target_id: str):
    """The LtconformSession of one target, created on first use (so --collect-only starts
    nothing). Every target's session shares the one pool (and attached world): the session pays
    one cold start per world size, however many targets it checks."""
    sessions = config.stash.setdefault(SESSIONS_KEY, {})
    session = sessions.get(target_id)
    if session is None:
        from .session import LtconformSession

        targets = config.stash[ALL_TARGETS_KEY][target_id]
        session = LtconformSession(config.stash[SETTINGS_KEY], targets, pool=_pool(config))
        session.attached = _attached(config)
        session.progress = _progress_lines(config, target_id)
        sessions[target_id] = session
    return session


def _pool(config: pytest.Config):
    pool = config.stash.get(POOL_KEY, None)
    if pool is None:
        from .world import WorldPool

        pool = WorldPool(timeout_name="--ltconform-timeout")
        config.stash[POOL_KEY] = pool
        _stop_on_sigterm(config)
    return pool


class SigtermAsInterrupt:
    """SIGTERM (what CI runners send on cancel) ends the session as Ctrl-C does: the running item
    stops, the report and summary are written for what finished, worlds are closed. Installed only
    while this process owns worlds, and only over the default handler; a second SIGTERM, or one
    that arrives once the session is finishing, gets the handler that was there before."""

    def __init__(self):
        self.previous = signal.getsignal(signal.SIGTERM)
        self.finishing = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        signal.signal(signal.SIGTERM, self.previous)
        if self.finishing:
            return  # the summary and clean-up are under way: let them end
        pytest.exit("pytest-ltconform: SIGTERM received; stopped the ranks, reporting what finished",
                    returncode=pytest.ExitCode.INTERRUPTED)

    def uninstall(self) -> None:
        if signal.getsignal(signal.SIGTERM) == self._handle:
            signal.signal(signal.SIGTERM, self.previous)


def _stop_on_sigterm(config: pytest.Config) -> None:
    if SIGTERM_KEY in config.stash or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    try:
        config.stash[SIGTERM_KEY] = SigtermAsInterrupt()
    except ValueError:  # not the main thread: signals cannot be handled here
        pass


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus) -> None:
    guard = session.config.stash.get(SIGTERM_KEY, None)
    if guard is not None:
        guard.finishing = True
    attached = _attached(session.config)
    if attached is not None and attached.rank != 0 and exitstatus not in (0, pytest.ExitCode.NO_TESTS_COLLECTED):
        # A quiet rank still says, in one line, that it did not succeed.
        sys.stderr.write(f"pytest-ltconform: {attached.info.describe()} finished with exit status "
                         f"{int(exitstatus)}; rank 0 prints the report for every rank.\n")


def pytest_unconfigure(config: pytest.Config) -> None:
    pool = config.stash.get(POOL_KEY, None)
    if pool is not None:
        pool.close()
    attached = _attached(config)
    if attached is not None:
        attached.close()
    guard = config.stash.get(SIGTERM_KEY, None)
    if guard is not None:
        guard.uninstall()


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    lines = [config.stash[UNSELECTED_KEY]] if UNSELECTED_KEY in config.stash else []
    attached = _attached(config)
    if attached is not None:
        lines.append(f"ltconform: pytest is {attached.info.describe()} (Lightning {attached.info.environment}); "
                     f"contract runs happen in that world and this rank reports every rank's verdicts")
    if config.stash.get(TARGETS_KEY, None) is not None:
        from . import tiers

        reasons = dict(_hidden(config).values())  # {tier: reason}: one line per tier, in item order
        lines += [tiers.not_run_line(tier, reason) for tier, reason in reasons.items()]
        lines += _overridden_line(config)
    return lines or None


def _overridden_line(config: pytest.Config) -> list[str]:
    """The header lines naming the user's Trainer kwargs that conformance runs replace (once,
    instead of in every item; per target, named, when there are several); none when nothing is
    replaced."""
    every = config.stash[ALL_TARGETS_KEY]
    lines = []
    for tid, targets in every.items():
        said = _overridden(config, targets)
        if said:
            named = f"{tid}: " if len(every) > 1 else ""
            lines.append(f"ltconform: {named}your Trainer kwargs: {', '.join(said)}")
    return lines


def _overridden(config: pytest.Config, targets) -> list[str]:
    """What conformance runs replace of one target's Trainer kwargs."""
    if targets.trainer is None and targets.trainer_dict is None:
        return []
    from . import harness
    from . import target as target_mod

    try:
        user = target_mod.user_trainer_kwargs(targets)
    except target_mod.TargetError:
        return []  # validated at start-up; a factory that fails only now is the items' to report
    settings, attached = config.stash[SETTINGS_KEY], _attached(config)
    strategies = tuple(s for s in settings.strategies if s != "deepspeed" or not _availability(config).missing(s))
    if attached is not None:
        said = harness.overridden(user, attached.world_size, accelerator=attached.accelerator, num_nodes=None,
                                  strategies=strategies)
    else:
        said = harness.overridden(user, settings.world_size, strategies=strategies)
    return said


def pytest_collection_finish(session: pytest.Session) -> None:
    attached = _attached(session.config)
    if attached is None:
        return
    from .world.attached import CollectionMismatch, host_facts

    facts = {**host_facts(attached.info.node_rank), "errors": session.testsfailed}
    timeout = max(300.0, session.config.stash[SETTINGS_KEY].timeout_s)
    try:
        attached.agree_collection([item.nodeid for item in session.items], facts, timeout_s=timeout)
    except CollectionMismatch as exc:
        message = f"pytest-ltconform: {exc}"
        if session.config.pluginmanager.get_plugin("terminalreporter") is None:
            sys.stderr.write(f"{attached.info.describe()}: {message}\n")  # a quiet rank says it too
        pytest.exit(message, returncode=pytest.ExitCode.USAGE_ERROR)


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
    """One (contract, variant) check on one target (``target_id``); the variant (tiers.Variant)
    names the tier, the strategy and the world."""

    def __init__(self, *, contract_id: str, strategy: str, variant=None, target_id: str = "", **kwargs):
        super().__init__(**kwargs)
        self.target_id = target_id
        self.contract_id = contract_id
        self.strategy = strategy
        self.variant = variant
        self.tier = variant.tier if variant is not None else "cpu"
        self.verdict_dict: dict | None = None
        self.required_missing: str | None = None

    def _tier_check(self) -> bool:
        """Skip (or, for a tier in --ltconform-require, fail) when the tier cannot run here."""
        if self.variant is None:
            return True
        avail = _availability(self.config)
        require = self.config.stash[SETTINGS_KEY].require
        for tier in self.variant.needs:
            reason = avail.missing(tier)
            if reason and tier in require:
                self.required_missing = (f"--ltconform-require {tier}: the {tier} tier cannot run here: {reason}. "
                                         f"The item fails instead of skipping so that a runner without that "
                                         f"hardware cannot pass silently.")
                self._record({**_unavailable(self.required_missing), "outcome": "failed"}, 0.0)
                return False
        first = avail.first_missing(self.variant)
        if first:
            self._record(_unavailable(first[1]), 0.0)
            pytest.skip(first[1])
        return True

    def _record(self, verdict_dict: dict, duration: float) -> None:
        """Carry this item's report record on its pytest reports (see report.from_report)."""
        from . import report

        multinode = self.tier == "multinode" and _attached(self.config) is not None
        world_size = _attached(self.config).world_size if multinode else self.config.stash[SETTINGS_KEY].world_size
        rec = report.record(self.contract_id, self.variant.label if self.variant else self.strategy, world_size,
                            verdict_dict, duration, target=self.target_id)
        self.user_properties.append((report.PROPERTY, json.dumps(rec)))

    def setup(self) -> None:
        if not self._tier_check():
            return
        session = _session(self.config, self.target_id)
        verdict, duration = session.verdict(self.contract_id, self.strategy, self.tier)
        self.verdict_dict = verdict.as_dict()
        self._record(self.verdict_dict, duration)
        if verdict.outcome == "skipped":
            pytest.skip(verdict.summary)
        if verdict.outcome == "error":
            raise NotJudged(self.verdict_dict)

    def runtest(self) -> None:
        if self.required_missing:
            pytest.fail(self.required_missing, pytrace=False)
        # An advisory (waste that breaks nothing) is reported, not failed: the item passes.
        if self.verdict_dict and self.verdict_dict["outcome"] == "failed":
            raise ContractFailed(self.verdict_dict)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, (ContractFailed, NotJudged)):
            return excinfo.value.verdict["message"]
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        # The module's class definition: -vv prints its file after the id.
        targets = self.config.stash.get(ALL_TARGETS_KEY, {}).get(self.target_id)
        source = getattr(targets, "model_source", None)
        if source and source[0]:
            return source[0], source[1] - 1, f"ltconform {self.target_id}::{self.name}"
        return self.path, None, f"ltconform {self.target_id}::{self.name}"


class RunFailed(Exception):
    """Raised by a run item whose run a rank's own failure stopped; carries the text."""


class LtconformRunItem(pytest.Item):
    """The run ``kind`` (e.g. the traced fit) of one target under one variant, shared by the
    contract items after it: a user's exception that stops the run is reported here, once, and
    those items are not judged and point here (DESIGN.md, "Blame"). It passes when the run
    finished, or stopped because of a contract's failure (that contract's item fails)."""

    def __init__(self, *, kind: str, contract_id: str, variant, target_id: str, **kwargs):
        super().__init__(**kwargs)
        self.kind, self.variant, self.target_id = kind, variant, target_id
        self.contract_id = contract_id  # the first contract item after it that needs the run

    def setup(self) -> None:
        first = _availability(self.config).first_missing(self.variant)
        if first:
            pytest.skip(first[1])

    def runtest(self) -> None:
        from . import report
        from .world import WorldStartError

        started = time.monotonic()
        session = _session(self.config, self.target_id)
        try:
            outcome, text = session.run_failure(self.contract_id, self.variant.strategy, self.variant.tier, self.name)
        except WorldStartError as exc:
            outcome, text = "error", f"[{self.name}] could not start a world: {exc}"
        summary = text.splitlines()[0].removeprefix(f"[{self.name}] ")
        # Its record carries the run's time (the contract items after it only judge).
        rec = report.record(self.kind, self.variant.label, self.config.stash[SETTINGS_KEY].world_size,
                            {"outcome": outcome, "message": text, "summary": summary,
                             "category": "crash" if outcome == "error" else None},
                            time.monotonic() - started, target=self.target_id)
        self.user_properties.append((report.PROPERTY, json.dumps({**rec, "run": True})))
        if outcome == "skipped":
            pytest.skip(text)
        if outcome == "error":
            raise RunFailed(text)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, RunFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.path, None, f"ltconform {self.target_id}::{self.name}"


class RunItems:
    """Adds, after -k and -m deselected, one run item before the first selected contract item of
    each run that several selected items share (the traced fit): one place for a failure of the
    run itself. A run that one item needs is reported on that item, as before."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config, items: list) -> None:
        if config.stash.get(ALL_TARGETS_KEY, None) is None:
            return
        from . import contracts

        users: dict = {}  # (target id, variant label, kind) -> [index of each contract item needing it]
        for n, item in enumerate(items):
            if isinstance(item, LtconformItem) and item.variant is not None:
                kind = contracts.get_contract(item.contract_id).run_spec.name
                users.setdefault((item.target_id, item.variant.label, kind), []).append(n)
        added, avail = {}, _availability(config)
        for (tid, _label, kind), where in users.items():
            # A tier that cannot run here skips (or fails) each of its items with the reason: no run.
            # The multinode tier is decided once the launched world agreed on the collection.
            variant = items[where[0]].variant
            if len(where) > 1 and variant.tier != "multinode" and not avail.first_missing(variant):
                added[where[0]] = _run_item(session, tid, kind, items[where[0]].contract_id, variant)
        if not added:
            return
        items[:] = [x for n, item in enumerate(items) for x in ((added[n], item) if n in added else (item,))]
        # Counted as collected, so pytest's "collected N items / M selected" adds up.
        config.hook.pytest_collectreport(report=pytest.CollectReport("ltconform-runs", "passed", None,
                                                                     list(added.values())))


def _run_item(parent, target_id: str, kind: str, contract_id: str, variant) -> LtconformRunItem:
    name = f"{kind}[{variant.label}]"
    item = LtconformRunItem.from_parent(parent, name=name, nodeid=f"ltconform::{target_id}::{name}", kind=kind,
                                        contract_id=contract_id, variant=variant, target_id=target_id)
    item.extra_keyword_matches.add(target_id)
    item.add_marker("ltconform")
    for marker in variant.markers:
        item.add_marker(marker)
    return item


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    # tryfirst: our items must exist before -k / -m deselection runs.
    if config.stash.get(ALL_TARGETS_KEY, None) is None:
        return
    first_new = len(items)
    hidden = _hidden(config)  # tiers that cannot run here and were not asked for: said in the header
    # Target first: every id names its target, also with one target, so that adding a second
    # model never renames the first one's items; a target's runs stay together.
    for target_id, targets in config.stash[ALL_TARGETS_KEY].items():
        for cid, contract, variant in _variants(config):
            if (cid, variant.label) not in hidden and _applies(contract, variant.strategy, targets):
                items.append(_item(session, target_id, cid, variant))
    # Report the generated items like collected ones, so "collected N items" counts them.
    config.hook.pytest_collectreport(
        report=pytest.CollectReport("ltconform", "passed", None, items[first_new:]))


def _item(parent, target_id: str, cid: str, variant) -> LtconformItem:
    item = LtconformItem.from_parent(
        parent, name=f"{cid}[{variant.label}]", nodeid=f"ltconform::{target_id}::{cid}[{variant.label}]",
        contract_id=cid, strategy=variant.strategy, variant=variant, target_id=target_id,
    )
    item.extra_keyword_matches.add(target_id)  # -k matches the target's id
    item.add_marker("ltconform")
    for marker in variant.markers:
        item.add_marker(marker)
    return item


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if isinstance(item, LtconformItem) and call.excinfo is not None and \
            isinstance(call.excinfo.value, (ContractFailed, NotJudged)):
        # Setup errors would otherwise render a traceback of our own code.
        report.longrepr = call.excinfo.value.verdict["message"]
    elif isinstance(item, LtconformItem) and report.when == "call" and report.passed and item.verdict_dict:
        # What the item checked, in one line: -rA prints it after "PASSED <id> - " as it prints a
        # failure's message, and -rP / the JSON report carry the same words.
        report.longrepr = _one_line(item.verdict_dict.get("summary") or "")
        # The one-line reason is trimmed to the terminal's width in the short summary; -rA / -rP
        # print a passed item's sections in full, so its notes (a DeepSpeed substitution, a
        # second fit), evidence and rule are readable there.
        first, _, rest = item.verdict_dict.get("message", "").partition("\n")
        plain = first == f"[{item.contract_id}] passed: {item.verdict_dict.get('summary')}"
        report.sections.append(("ltconform", (rest if plain else f"{first}\n{rest}").strip() or "(no notes)"))
    elif isinstance(item, LtconformRunItem) and report.skipped and isinstance(report.longrepr, tuple):
        report.longrepr = (item.nodeid, None, report.longrepr[2])  # -rs: the item, not the plugin's file
    elif isinstance(item, LtconformItem) and report.skipped and isinstance(report.longrepr, tuple):
        # -rs names where a skip was raised: the plugin's own file means nothing to a user. A tier
        # that cannot run here reads "SKIPPED [n] ltconform: <reason>" (one line for all its
        # items); an item left not judged names itself, since its reason names another item.
        where = item.nodeid if item.verdict_dict else "ltconform"
        report.longrepr = (where, None, report.longrepr[2])
    return report


def _one_line(text: str) -> str:
    return " ".join(text.split())


def pytest_report_teststatus(report, config):
    if report.when == "call" and report.passed:
        from . import report as report_mod

        rec = report_mod.from_report(report)
        if rec and rec["outcome"] == "advisory":
            return "advisory", "A", ("ADVISORY", {"yellow": True})
    return None


class PassedReasons:
    """Under ``-v``: below each passed contract item's line, what it checked (the verdict's summary)."""

    def __init__(self, terminalreporter):
        self.tr = terminalreporter

    @pytest.hookimpl(trylast=True)  # after the terminal reporter wrote the item's "PASSED" line
    def pytest_runtest_logreport(self, report) -> None:
        if report.when != "call" or not report.passed or not isinstance(report.longrepr, str):
            return
        if self.tr.config.pluginmanager.get_plugin("terminalreporter") is not self.tr:
            return  # a quiet rank of a launched world dropped its reporter: print nothing
        from . import report as report_mod

        rec = report_mod.from_report(report)
        if rec is None or rec["outcome"] != "passed" or not report.longrepr:
            return
        line = f"    {report.longrepr}"
        width = self.tr._tw.fullwidth - 1
        if self.tr.config.get_verbosity() < 2 and len(line) > width:  # as pytest trims skip reasons
            line = line[:width - 3] + "..."
        self.tr.ensure_newline()
        self.tr.write(line, light=True)


class ResultsCollector:
    """Collects every ltconform record from the reports (also those xdist workers send back),
    prints the summary table and writes the JSON report."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.results: list[dict] = []
        self.report_error: str | None = None
        self.report_line: str | None = None  # where the report went, or why it was left as it was

    @pytest.hookimpl(tryfirst=True)  # before the terminal reporter writes the outcome
    def pytest_runtest_logreport(self, report) -> None:
        from . import report as report_mod

        _end_live_line(self.config, report.nodeid)
        rec = report_mod.from_report(report)
        # One record per item: the call phase, or the setup phase when setup did not pass.
        if rec is not None and (report.when == "call" or (report.when == "setup" and not report.passed)):
            self.results.append(rec)

    @pytest.hookimpl(tryfirst=True)
    def pytest_keyboard_interrupt(self) -> None:
        _end_live_line(self.config)  # Ctrl-C or SIGTERM during a run: pytest's banner starts a line

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.results:
            from . import report as report_mod

            tw = terminalreporter._tw
            width = min(getattr(tw, "fullwidth", 100), 100)
            terminalreporter.write_sep("=", "ltconform summary", bold=True)
            if all(r.get("category") == "unavailable" and r["outcome"] == "skipped" for r in self.results):
                # A run of skips only must not read as a pass: say that nothing was judged, and why.
                reasons = "; ".join(dict.fromkeys(r["summary"] for r in self.results))
                terminalreporter.write_line(f"ltconform: nothing was judged: every selected item needs a tier that "
                                            f"cannot run here: {reasons}", yellow=True, bold=True)
            else:
                # Each failure's block is printed once: in FAILURES, or here when --tb=no leaves it out.
                text = report_mod.summary_text(self.results, width=width, color=tw.hasmarkup,
                                               blocks=self.config.getoption("tbstyle", "auto") == "no")
                for line in text.splitlines():
                    terminalreporter.write_line(line)
        if self.report_error:
            terminalreporter.write_line(self.report_error, red=True, bold=True)
        if self.report_line and self.report_line.startswith("ltconform:"):
            terminalreporter.write_line(self.report_line, yellow=True)
        elif self.report_line:
            terminalreporter.write_sep("-", self.report_line)  # as --junitxml says where its file went

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus) -> None:
        settings = self.config.stash.get(SETTINGS_KEY, None)
        if settings is None or not settings.report or hasattr(self.config, "workerinput"):
            return
        attached = _attached(self.config)
        if attached is not None and attached.rank != 0:
            return  # rank 0 writes the report for every rank
        if all(r["outcome"] == "skipped" for r in self.results) and os.path.exists(settings.report):
            # `pytest -m "not ltconform"` with the report in the ini file must not wipe the last verdicts.
            self.report_line = (f"ltconform: nothing was judged, so the JSON report {settings.report} was left "
                                f"as an earlier session wrote it")
            return
        from . import report as report_mod

        pool = self.config.stash.get(POOL_KEY, None)
        status = int(exitstatus)
        try:
            report_mod.write_json(settings.report, settings.target, settings.world_size, list(self.results),
                                  targets=list(self.config.stash.get(ALL_TARGETS_KEY, {}).values()),
                                  cold_starts=pool.cold_starts if pool is not None else None,
                                  not_run=_not_run(self.config),
                                  interrupted=status == pytest.ExitCode.INTERRUPTED or bool(session.shouldstop),
                                  exitstatus=status)
        except OSError as exc:
            # Checked at start-up, yet the disk can fill or the folder go: the summary still prints.
            self.report_error = (f"pytest-ltconform: could not write the JSON report to {settings.report}: "
                                 f"{exc.strerror or exc}; the verdicts are in the summary above.")
            if self.config.pluginmanager.get_plugin("terminalreporter") is None:
                sys.stderr.write(self.report_error + "\n")
            return
        self.report_line = f"generated ltconform report file: {os.path.abspath(settings.report)}"


# -- progress of long runs ---------------------------------------------------------------------

def _progress_every_s() -> float:
    raw = os.environ.get(PROGRESS_ENV, "")
    try:
        return float(raw) if raw.strip() else PROGRESS_EVERY_S
    except ValueError:
        return PROGRESS_EVERY_S


def _progress_lines(config: pytest.Config, target_id: str | None = None):
    """``for_run(label)`` -> the progress callback of one run (see LocalWorld.run), which writes a
    live line once the run has taken ``LTCONFORM_PROGRESS_S`` (default 10 s) and then as often; None
    where nothing may be printed: 0 seconds, ``-qq``, an xdist worker, a quiet rank of a launched
    world (its terminal reporter is gone). With several targets the label names ``target_id``."""
    every = _progress_every_s()
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if every <= 0 or reporter is None or config.get_verbosity() <= -2 or hasattr(config, "workerinput"):
        return None

    named = f"{target_id}::" if target_id is not None and len(config.stash.get(ALL_TARGETS_KEY, {})) > 1 else ""

    def for_run(label: str):
        due = [every]

        def progress(elapsed_s: float, idle_s: dict) -> None:
            if elapsed_s < due[0]:
                return
            due[0] = (elapsed_s // every + 1) * every
            _write_live(config, reporter, progress_line(named + label, elapsed_s, idle_s, stalled_after_s=every))

        return progress

    return for_run


def progress_line(label: str, elapsed_s: float, idle_s: dict, stalled_after_s: float) -> str:
    """``ltconform: fit[ddp] running, 30 s``, plus the ranks whose trace has not grown for
    ``stalled_after_s`` seconds or more (``idle_s``: {rank: seconds})."""
    line = f"ltconform: {label} running, {elapsed_s:.0f} s"
    stalled = [f"rank {r} (no progress for {s:.0f} s)" for r, s in sorted(idle_s.items()) if s >= stalled_after_s]
    return line + (f"; waiting for {', '.join(stalled)}" if stalled else "")


def _write_live(config: pytest.Config, reporter, line: str) -> None:
    """Write ``line`` now on a line of its own, also while pytest captures output (item setup): with
    its global capture suspended, and flushed before capture resumes. The line is left open;
    ``_end_live_line`` ends it before pytest writes the item's outcome, so that outcome keeps its
    prefix instead of standing alone on a line."""
    capman = config.pluginmanager.get_plugin("capturemanager")
    with capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext():
        reporter.ensure_newline()
        if config.get_terminal_writer().width_of_current_line:  # -q's dots, or our previous line
            reporter.write("\n")
        reporter.write(line)
        reporter.flush()
    config.stash[LIVE_OPEN_KEY] = True


def _end_live_line(config: pytest.Config, nodeid: str | None = None) -> None:
    """After a live line, pytest's next output starts a line of its own: under the default
    verbosity with the item's file prefix (``ltconform ``) before its outcome letter; under -v
    pytest writes the item's id again itself."""
    if not config.stash.get(LIVE_OPEN_KEY, False):
        return
    config.stash[LIVE_OPEN_KEY] = False
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    if nodeid is not None and config.get_verbosity() == 0 and reporter.showfspath:
        reporter.write_fspath_result(nodeid, "")
    elif nodeid is None or config.get_verbosity() < 0:
        reporter.write("\n")


# -- fixtures ------------------------------------------------------------------------------------

class WorldHandle:
    """What ``ltconform_world(...)`` returns: ``run(fn, *args)`` on every rank of ``world`` (a
    ``world.World``: a local one from the session's pool, or the launched world pytest runs in)."""

    def __init__(self, world, timeout_s: float, timeout_name: str = "--ltconform-timeout"):
        self._world = world
        self.world_size = world.world_size
        self.timeout_s = timeout_s
        self.timeout_name = timeout_name  # named when a run is killed at the limit

    def run(self, fn, *args, timeout_s: float | None = None) -> list:
        """Run ``fn(ctx, *args)`` on every rank; ``fn`` must be importable (module level).

        Returns the per-rank return values in rank order. Fails the test with every failed
        rank's traceback (rank-tagged) and the hang diagnosis when any rank raises, dies or hangs.
        """
        ref = fn if isinstance(fn, str) else f"{fn.__module__}:{fn.__qualname__}"
        if not isinstance(fn, str) and "<locals>" in fn.__qualname__:
            raise pytest.UsageError(f"ltconform_world.run: {fn.__qualname__} is a local function; ranks import "
                                    f"the function by name, so define it at module level.")
        from .world import JobRequest

        limit, name = (timeout_s, "timeout_s") if timeout_s else (self.timeout_s, self.timeout_name)
        result = self._world.run(JobRequest(ref, args, timeout_s=limit, timeout_name=name))
        if result.status == "skip":
            pytest.skip(result.ranks[0].message or "skipped inside the ranks")
        if result.status != "ok":
            failed = [str(r.rank) for r in result.ranks if r.status != "ok"]
            pytest.fail(f"ltconform_world.run({ref}) failed on rank(s) {', '.join(failed)} of a "
                        f"{result.world_size}-rank world:\n"
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

    attached = _attached(config)

    def make(world_size: int | None = None, timeout_s: float | None = None) -> WorldHandle:
        timeout = timeout_s or settings.timeout_s
        pg_timeout = settings_mod.pg_timeout_for(timeout)
        name = "timeout_s" if timeout_s else "--ltconform-timeout"
        if attached is not None:  # inside torchrun/SLURM: the launched world is the world
            if world_size not in (None, attached.world_size):
                pytest.skip(f"needs a world of {world_size} ranks; pytest is {attached.info.describe()}")
            return WorldHandle(attached, timeout, name)
        return WorldHandle(_pool(config).get(world_size or settings.world_size, pg_timeout_s=pg_timeout), timeout, name)

    return make


@pytest.fixture
def ltconform_target(request):
    """The validated target (``target.Targets``) of this session; with several targets, the
    first (skips when no target is set)."""
    targets = request.config.stash.get(TARGETS_KEY, None)
    if targets is None:
        pytest.skip("no --ltconform target given")
    return targets
