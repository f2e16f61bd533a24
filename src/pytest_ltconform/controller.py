"""The plugin's per-session state and life cycle, kept in ``config.stash``: settings, validated
targets, the world pool and the attached world, tier availability, one LtconformSession per
target, SIGTERM handling. ``plugin.py``'s hooks delegate here; nothing heavy is imported until
``--ltconform`` (or its ini twin, or an ``ltconform_*`` fixture) is in use."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys

import pytest

from . import contracts, progress
from . import settings as settings_mod

TARGETS_KEY = pytest.StashKey["object"]()  # target.spec.ResolvedTarget of the first target, once validated
ALL_TARGETS_KEY = pytest.StashKey[dict]()  # target id -> target.spec.ResolvedTarget, every target in order
SESSIONS_KEY = pytest.StashKey[dict]()  # target id -> session.LtconformSession, created on first use
SETTINGS_KEY = pytest.StashKey["settings_mod.Settings"]()
POOL_KEY = pytest.StashKey["object"]()
ATTACHED_KEY = pytest.StashKey["object"]()
AVAILABILITY_KEY = pytest.StashKey["object"]()
FACTS_KEY = pytest.StashKey[dict]()  # what the process that validated the targets saw of the machine
ONLY_CONTRACTS_KEY = pytest.StashKey[bool]()
SIGTERM_KEY = pytest.StashKey["SigtermAsInterrupt"]()
HIDDEN_KEY = pytest.StashKey[dict]()
UNSELECTED_KEY = pytest.StashKey[str]()  # why the project's own targets add no item to this run
DESELECTED_KEY = pytest.StashKey[str]()  # -m deselects every item of the --ltconform targets
REPORTERS_KEY = pytest.StashKey[dict]()  # target id -> {(kind, strategy, tier): the item reporting that run}
SHARE_KEY = pytest.StashKey["object"]()  # world.share.SessionShare of a pytest-xdist session (controller or worker)
XDIST_REPORT_KEY = pytest.StashKey[dict]()  # the xdist controller's: what its workers' sessions made (workers.py)
# workerinput of a pytest-xdist worker: {"path", "owner", "workers", "slots"} of the session's share.
SHARE_INPUT = "ltconform_share"

MARKERS = {
    "ltconform": "a generated pytest-ltconform contract item",
    "ltconform_cpu": "runs on CPU gloo ranks (every machine)",
    "ltconform_gpu": "needs at least 2 CUDA devices and NCCL",
    "ltconform_multinode": "needs an existing world that spans several nodes (torchrun, SLURM)",
    "ltconform_deepspeed": "runs real DeepSpeed ZeRO (CPU gloo ranks, or CUDA on the GPU tier); needs deepspeed "
                           "importable (pip install 'deepspeed>=0.16')",
    "ltconform_nodes": "runs on local CPU gloo ranks laid out as several nodes on this host (--ltconform-nodes)",
}


def resolve_settings(config: pytest.Config):
    """The session's settings (stashed), and the header line when the project's own targets are
    not checked in this run; with the bad inputs found so far (messages; the settings then hold
    the defaults for those), which :func:`start` reports with its own in one paragraph."""
    selected = _selects_project_contracts(config)
    try:
        settings, problems = settings_mod.resolve(config, project_targets=selected), []
    except settings_mod.InputProblems as exc:
        settings, problems = exc.settings, exc.problems
    if settings.targets and _deselects_every_contract_item(config):
        # `-m "not ltconform" --ltconform X`: every item of X would be deselected; say so, import nothing.
        named = ", ".join(t.id for t in settings.targets)
        config.stash[DESELECTED_KEY] = (
            f"ltconform: -m {config.getoption('markexpr')!r} deselects every contract item, so {named} is not "
            f"checked in this run (nothing of it was imported); drop that -m, or select the items with -m ltconform")
        config.stash[ONLY_CONTRACTS_KEY] = contracts_alone(config)
    if not selected and config.args_source == pytest.Config.ArgsSource.ARGS and config.getini(settings_mod.INI_TARGET):
        # Paths named, contract items not deselected: say so, or a CI job running `pytest tests/` reads as checked.
        config.stash[UNSELECTED_KEY] = (
            f"ltconform: the {settings_mod.INI_TARGET} targets are not checked in this run: it names test paths "
            f"(run `pytest -m ltconform`, or pytest without paths, to check them)")
    config.stash[SETTINGS_KEY] = settings
    return settings, problems


def start(config: pytest.Config, settings, problems: list[str] = ()) -> None:
    """With ``--ltconform`` in use: check the machine's capacity, validate every target, attach to
    a launched world, and decide whether the contract items run alone. ``problems`` are the bad
    inputs :func:`resolve_settings` found: every target is still validated, so that one
    ``pytest.UsageError`` names all of them (and the targets' own) in one paragraph."""
    from . import tiers

    problems = list(problems)
    if tiers.detect_attached() is None:  # a launched world is the launcher's to size and to stop
        if not hasattr(config, "workerinput"):
            try:
                settings_mod.check_capacity(settings)  # before anything heavy is imported or started
            except pytest.UsageError as exc:
                problems.append(str(exc))
        stop_on_sigterm(config)
    _add_project_contracts(config)
    validated = _validate_targets(config, settings, problems)
    if problems:
        raise settings_mod.InputProblems(problems)
    config.stash[ALL_TARGETS_KEY] = validated
    config.stash[TARGETS_KEY] = next(iter(validated.values()))
    attach(config, settings)
    config.stash[ONLY_CONTRACTS_KEY] = contracts_alone(config)


def contracts_alone(config: pytest.Config) -> bool:
    """`pytest --ltconform X` with no test paths runs the contracts alone; with paths given, or
    with the target in the ini file, the contract items join the normal test run."""
    from_command_line = config.getoption(settings_mod.OPT_TARGET) not in (None, "")
    return from_command_line and config.args_source != pytest.Config.ArgsSource.ARGS


def deselected_line(config: pytest.Config) -> str | None:
    """The line saying that ``-m`` deselects every item of the targets named with ``--ltconform``."""
    return config.stash.get(DESELECTED_KEY, None)


def target_on_demand(config: pytest.Config):
    """The first target (a ``ResolvedTarget``), validated now for a test that asks for it (the
    ``ltconform_target`` fixture) where ``-m`` deselected every contract item, so :func:`start`
    validated nothing; None without a target. Fails that test, naming the target and the fix, for
    a bad one. The end line then says the target was imported, for that test only."""
    settings = config.stash.get(SETTINGS_KEY, None)
    if settings is None or not settings.targets:
        return None
    from . import validation
    from .target import spec as target_spec

    try:
        resolved = validation.validate_here(settings_mod.validate_args(settings, settings.targets[0]))
    except target_spec.TargetError as exc:
        pytest.fail(f"ltconform_target: {exc}", pytrace=False)
    config.stash[TARGETS_KEY] = resolved
    line = config.stash.get(DESELECTED_KEY, None)
    if line is not None:
        config.stash[DESELECTED_KEY] = line.replace(
            "(nothing of it was imported)", "(only imported for a test's ltconform_target fixture)")
    return resolved


def _add_project_contracts(config: pytest.Config) -> None:
    """Register the contracts of every ``pytest_ltconform_contracts`` implementation; raises
    ``pytest.UsageError`` naming a contract that cannot be judged and the fix."""
    from . import contracts

    for result in config.hook.pytest_ltconform_contracts(config=config):
        for contract in result if isinstance(result, (list, tuple)) else [result]:
            try:
                contracts.add(contract)
            except ValueError as exc:
                raise pytest.UsageError(f"pytest_ltconform_contracts: {exc}.") from None


def explain(config: pytest.Config, contract_id: str) -> str:
    """``--ltconform-explain``: the rule page of ``contract_id``, one of the plugin's (shipped in the
    package) or one the project registers through ``pytest_ltconform_contracts``. Raises
    ``pytest.UsageError`` for an unknown id, naming the close one and every id."""
    from . import contracts
    from . import report as report_mod

    page = report_mod.contract_page(contract_id)
    if page is not None:
        return page  # no hook called: a built-in page needs nothing of the project's
    try:
        _add_project_contracts(config)
        own = {contract.id: contract for contract in contracts.added()}
    finally:
        contracts.forget_added()
    if contract_id in own:
        return report_mod.own_contract_page(own[contract_id])
    raise pytest.UsageError(f"--ltconform-explain: {report_mod.unknown_contract(contract_id, list(own))}")


def _selects_project_contracts(config: pytest.Config) -> bool:
    """Whether this run selects the contract items of targets the project declares (ini list,
    ``pytest_ltconform_targets``): yes for a run that names no test path (``pytest``, ``pytest -k
    ...``) or whose ``-m`` names an ltconform marker; never when ``-m`` deselects every contract
    item. So ``pytest tests/test_x.py::test_y`` and ``pytest -m "not ltconform"`` cost what they
    cost without the plugin: no torch or Lightning import, no target validated, no item added."""
    from . import tiers

    if _deselects_every_contract_item(config):
        return False
    try:
        markexpr = tiers.MarkExpression.parse(config.getoption("markexpr", ""))
    except ValueError:
        return True  # pytest reports a malformed -m itself
    return config.args_source != pytest.Config.ArgsSource.ARGS or any(markexpr.names(m) for m in MARKERS)


def _deselects_every_contract_item(config: pytest.Config) -> bool:
    """Whether ``-m`` leaves out the contract items of every tier (``-m "not ltconform"``)."""
    from types import SimpleNamespace

    from . import tiers
    from .vocabulary import CPU_STRATEGIES, STRATEGIES, TIERS

    try:
        markexpr = tiers.MarkExpression.parse(config.getoption("markexpr", ""))
    except ValueError:
        return False  # pytest reports a malformed -m itself
    every_tier = tiers.variants(SimpleNamespace(strategies=STRATEGIES, tiers=TIERS), STRATEGIES, CPU_STRATEGIES)
    return not any(markexpr.matches({"ltconform", *variant.markers}) for variant in every_tier)


def _validate_targets(config: pytest.Config, settings, problems: list[str]) -> dict:
    """Import and check every target, each apart from the others (see :mod:`.validation`: in a
    process forked from the fork launcher's parent, or here); ``{id: target.spec.ResolvedTarget}``
    in order. Appends to ``problems`` the message of each target that fails, naming the target (and
    which of the list) and the fix."""
    from . import validation
    from .target import spec as target_spec
    from .world import WorldStartError

    world = _validation_world(config, settings)
    facts: dict = {}
    validated = {}
    count = len(settings.targets)
    share, _ = shared(config)
    for n, declared in enumerate(settings.targets, 1):
        kwargs = settings_mod.validate_args(settings, declared)

        def validate(kwargs=kwargs):  # (target, facts) or the TargetError: what every worker gets
            nonlocal world
            seen: dict = {}
            try:
                resolved = None
                if world is not None:
                    try:
                        resolved = validation.validate_forked(world, kwargs, seen)
                    except WorldStartError:
                        world = None  # the parent cannot start: validate here; the first run says why
                return (resolved if resolved is not None else validation.validate_here(kwargs)), seen
            except target_spec.TargetError as exc:
                return exc, seen

        # Under xdist one worker validates each target and the others take its answer.
        resolved, seen = share.once(f"target-{n}", validate) if share is not None else validate()
        facts.update(seen)
        if isinstance(resolved, target_spec.TargetError):
            which = f"target {n} of {count} ({declared.id}): " if count > 1 else ""
            problems.append(f"{which}{resolved}")
        else:
            validated[declared.id] = resolved
    if world is not None and "deepspeed" in settings.strategies:  # asked at collection, if at all
        facts["deepspeed_missing"] = functools.partial(validation.deepspeed_missing_in_parent, world)
    config.stash[FACTS_KEY] = facts
    return validated


def _validation_world(config: pytest.Config, settings):
    """The local CPU world whose fork parent validates the targets (its ranks' parent too), or
    None: validate here under the spawn launcher, in a launched world, and where this process
    imported Lightning already (a conftest or another plugin did: validating here costs nothing
    more, and a fork parent the run may not need is not started for it)."""
    from . import tiers

    if settings.launcher != "fork" or tiers.detect_attached() is not None:
        return None
    if {"lightning", "pytorch_lightning"} & set(sys.modules):
        return None
    cpu = tiers.get("cpu")
    return cpu.world(pool(config), None, cpu.layout(settings.world_size), settings.pg_timeout_s)


def contracts_only(config: pytest.Config) -> bool:
    """``pytest --ltconform X`` with no test paths: the contract items run alone."""
    return config.stash.get(ONLY_CONTRACTS_KEY, False)


def attach(config: pytest.Config, settings) -> None:
    """Inside a torchrun or SLURM world: spawn nothing, run the contracts in that world, and let
    only rank 0 print (every rank reaches the same verdicts). Also where ``-m`` deselected every
    contract item (:func:`start` not called): the ranks must still collect alike (see
    :func:`agree_collection`) and the ``ltconform_world`` fixture runs in that world."""
    from . import tiers

    info = tiers.detect_attached()
    if info is None:
        return
    if config.getoption("numprocesses", None) or hasattr(config, "workerinput"):
        raise no_xdist_in_launched_world(info)
    from .world.attached import AttachedWorld

    config.stash[ATTACHED_KEY] = AttachedWorld(info, pg_timeout_s=settings.pg_timeout_s)
    if info.rank != 0:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


def no_xdist_in_launched_world(info) -> pytest.UsageError:
    """The usage error of ``-n`` inside a torchrun or SLURM world (``info``: tiers.Attached)."""
    return pytest.UsageError(
        f"pytest-ltconform: pytest is {info.describe()}; pytest-xdist workers (-n) cannot share one "
        f"rank of that world. Drop -n: the launcher already runs one pytest per rank.")


def attached_world(config: pytest.Config):
    """The launched world pytest is a rank of (world.attached.AttachedWorld), or None."""
    return config.stash.get(ATTACHED_KEY, None)


def availability(config: pytest.Config):
    avail = config.stash.get(AVAILABILITY_KEY, None)
    if avail is None:
        from .tiers import Availability

        attached = attached_world(config)
        facts = config.stash.get(FACTS_KEY, {})  # what the process that validated the targets saw
        seen = {}
        if "cuda" in facts:
            seen["cuda_count"] = lambda: facts["cuda"]
        if "deepspeed_missing" in facts:  # the ranks' parent imports it; this process must find it too
            seen["deepspeed_missing"] = facts["deepspeed_missing"]
        settings = config.stash[SETTINGS_KEY]
        avail = Availability(settings.world_size, attached.info if attached else None,
                             attached.num_nodes if attached else None, nodes=settings.nodes, **seen)
        config.stash[AVAILABILITY_KEY] = avail
    elif avail.num_nodes is None and attached_world(config) is not None:
        avail.num_nodes = attached_world(config).num_nodes  # agreed by every rank once collection finished
    return avail


def variants(config: pytest.Config):
    """Every (contract id, contract, tiers.Variant) the session's strategies give, in item order."""
    from . import contracts, tiers
    from .vocabulary import CPU_STRATEGIES

    settings = config.stash[SETTINGS_KEY]
    for cid in contracts.ids():
        contract = contracts.get_contract(cid)
        for variant in tiers.variants(contract, settings.strategies, CPU_STRATEGIES, settings.nodes):
            yield cid, contract, variant


def hidden(config: pytest.Config) -> dict:
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
        with output_swallowed(config):  # importing deepspeed to check it prints a warning to stdout
            for cid, _contract, variant in variants(config):
                why = tiers.hidden_reason(variant, availability(config), settings.require, markexpr,
                                          settings.strategies_named)
                if why:
                    hidden[(cid, variant.label)] = why
        config.stash[HIDDEN_KEY] = hidden
    return hidden


@contextlib.contextmanager
def output_swallowed(config: pytest.Config):
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


def applies(contract, strategy: str, targets, variant=None) -> bool:
    """Whether ``contract`` has an item under ``strategy`` (in ``variant``, a tiers.Variant) for
    ``targets``: some strategies are judged only where the target's Trainer config names them
    (``Contract.configured_only``, ``Variant.configured_only``)."""
    if variant is not None and variant.configured_only and not targets.configures(strategy):
        return False
    return strategy not in contract.configured_only or targets.configures(strategy)


def session_for(config: pytest.Config, target_id: str):
    """The LtconformSession of one target, created on first use (so --collect-only starts
    nothing). Every target's session shares the one pool (and attached world): the session pays
    one cold start per world size, however many targets it checks."""
    sessions = config.stash.setdefault(SESSIONS_KEY, {})
    session = sessions.get(target_id)
    if session is None:
        from .session import LtconformSession

        targets = config.stash[ALL_TARGETS_KEY][target_id]
        share, _ = shared(config)
        runs = None
        if share is not None and not pool(config).fresh_per_job:
            from .run_cache import SharedRuns

            runs = SharedRuns(share)  # made once across the session's xdist workers
        session = LtconformSession(config.stash[SETTINGS_KEY], targets, pool=pool(config), runs=runs,
                                   reporters=config.stash.get(REPORTERS_KEY, {}).get(target_id))
        session.attached = attached_world(config)
        several = len(config.stash[ALL_TARGETS_KEY]) > 1
        session.progress = progress.progress_lines(config, target_id if several else None)
        sessions[target_id] = session
    return session


def pool(config: pytest.Config):
    pool = config.stash.get(POOL_KEY, None)
    if pool is None:
        from .world import WorldPool

        settings = config.stash.get(SETTINGS_KEY, None) or settings_mod.Settings(target=None)
        share, slots = shared(config)
        pool = WorldPool(timeout_name="--ltconform-timeout", launcher=settings.launcher, preload=preload_for(settings),
                         share=share, slots=slots)
        config.stash[POOL_KEY] = pool
        stop_on_sigterm(config)
    return pool


def shared(config: pytest.Config):
    """(world.share.SessionShare, world slots) of a pytest-xdist worker whose controller made the
    session's folder (see workers.py); (None, None) elsewhere."""
    given = getattr(config, "workerinput", {}).get(SHARE_INPUT)
    if given is None:
        return None, None
    share = config.stash.get(SHARE_KEY, None)
    if share is None:
        from .world.share import SessionShare

        share = config.stash[SHARE_KEY] = SessionShare(given["path"], given["owner"])
    return share, given["slots"]


def made_runs(config: pytest.Config) -> list[dict]:
    """Every run this process's sessions made (``runs.RunKey`` fields; the world's layout as
    ``nodes`` x ``ranks_per_node``, None for a launched world's own), in order."""
    made = []
    for session in config.stash.get(SESSIONS_KEY, {}).values():
        for key in session.runs_made():
            layout = key.layout
            made.append({"target": key.target, "kind": key.kind, "strategy": key.strategy, "tier": key.tier,
                         "nodes": layout.nodes if layout else None,
                         "ranks_per_node": layout.ranks_per_node if layout else None})
    return made


def preload_for(settings) -> tuple[str, ...]:
    """What the ranks import before their first job (once per session under the fork launcher):
    Lightning, what the selected strategies import on every rank (DeepSpeed left out quietly
    where it is not installed) and the plugin's own rank-side modules.
    ``LTCONFORM_PRELOAD`` (comma-separated modules) replaces it: e.g. ``torch`` for tests of the
    ``ltconform_world`` fixture that never import Lightning."""
    from .world.protocol import PRELOAD_ENV

    if PRELOAD_ENV in os.environ:
        return tuple(name.strip() for name in os.environ[PRELOAD_ENV].split(",") if name.strip())
    strategies = settings.strategies if settings.enabled else ()
    return contracts.preload(strategies)


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


def stop_on_sigterm(config: pytest.Config) -> None:
    if SIGTERM_KEY in config.stash or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    try:
        config.stash[SIGTERM_KEY] = SigtermAsInterrupt()
    except ValueError:  # not the main thread: signals cannot be handled here
        pass


def finishing(session: pytest.Session, exitstatus) -> None:
    """The session is finishing: a second SIGTERM now gets the previous handler; a quiet rank of a
    launched world says in one line that it did not succeed."""
    guard = session.config.stash.get(SIGTERM_KEY, None)
    if guard is not None:
        guard.finishing = True
    attached = attached_world(session.config)
    if attached is not None and attached.rank != 0 and exitstatus not in (0, pytest.ExitCode.NO_TESTS_COLLECTED):
        # A quiet rank still says, in one line, that it did not succeed.
        sys.stderr.write(f"pytest-ltconform: {attached.info.describe()} finished with exit status "
                         f"{int(exitstatus)}; rank 0 prints the report for every rank.\n")


def close(config: pytest.Config) -> None:
    """Stop every world this process owns, put back the SIGTERM handler and forget the project's
    contracts."""
    from . import contracts

    contracts.forget_added()
    pool = config.stash.get(POOL_KEY, None)
    if pool is not None:
        pool.close()
    attached = attached_world(config)
    if attached is not None:
        attached.close()
    guard = config.stash.get(SIGTERM_KEY, None)
    if guard is not None:
        guard.uninstall()


def agree_collection(session: pytest.Session) -> None:
    """In a launched world: check that every rank collected the same items (else exit with why)."""
    attached = attached_world(session.config)
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
