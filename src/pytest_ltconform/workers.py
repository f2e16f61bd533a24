"""pytest-xdist, as a user runs it (``pytest -n N --ltconform X``): what the controller gives its
workers, and what it takes back from them.

The controller imports neither torch nor Lightning, validates nothing and starts no fork parent:
it only makes the session folder (``world.share``) and names it to every worker, with the number
of world slots the machine's CPUs allow. The workers share the rest through that folder: each
target is validated once, each run is made once (``run_cache.SharedRuns``), one fork parent per
preload list serves every worker's ranks (``world.launch.fork``), and at most that many worlds
run at once. What the header says of the targets, and a target that cannot be checked, come from
the first worker that validated them (:func:`publish`), and the controller says them when a
worker is ready; what the JSON report needs of the workers' sessions comes back with each
worker's end (``workeroutput``).
"""

from __future__ import annotations

import os
import shutil

import pytest

from . import controller
from . import settings as settings_mod

OUTPUT_KEY = "ltconform"  # workeroutput: what the controller's report needs of a worker's sessions
INPUT_STASH = pytest.StashKey[dict]()  # the controller's controller.SHARE_INPUT value
OUTPUTS_KEY = pytest.StashKey[list]()  # the controller's: each finished worker's OUTPUT_KEY value
FACTS = "facts"  # the share's value: {"header": [lines], "problems": text | None, "not_run", "targets"}


def is_controller(config: pytest.Config) -> bool:
    """Whether this process is the controller of a pytest-xdist session (``-n``, ``--dist``)."""
    if hasattr(config, "workerinput") or config.getoption("collectonly", False):
        return False
    return config.getoption("dist", "no") != "no" and bool(config.getoption("tx", None))


def count(config: pytest.Config) -> int:
    """The controller's number of workers."""
    return len(config.getoption("tx", None) or [])


def _local(config: pytest.Config) -> bool:
    """Whether every worker runs on this machine (``popen``): only they can share the folder."""
    return all(str(spec).startswith("popen") for spec in config.getoption("tx", None) or [])


def slots_for(settings, workers: int) -> int | None:
    """World slots of a session: as many worlds of ``settings.world_size`` ranks as the CPUs
    hold at once (at least one; a larger world is refused by the capacity check); None (no
    bound) under ``--ltconform-oversubscribe``."""
    if settings.oversubscribe:
        return None
    return max(1, settings_mod.cpu_count() // settings.world_size)


def start_controller(config: pytest.Config, settings, problems: list[str] = ()) -> None:
    """The controller's part of ``--ltconform``: refuse what no worker could run (a launched
    world, a machine too small for the workers' worlds, a bad option: one paragraph), then make
    the session folder and name it to every worker it starts. No torch, no Lightning, no fork
    parent, no target validated here: the workers do that, once between them."""
    from . import tiers

    info = tiers.detect_attached()
    if info is not None:
        raise controller.no_xdist_in_launched_world(info)
    problems = list(problems)
    try:
        settings_mod.check_capacity(settings, workers=count(config))
    except pytest.UsageError as exc:
        problems.append(str(exc))
    if problems:
        raise settings_mod.InputProblems(problems)
    if not _local(config):
        return  # workers on other hosts: each keeps its own worlds, as before
    from .world import session_folder
    from .world.share import SessionShare

    share = SessionShare(session_folder(), os.getpid())
    config.stash[controller.SHARE_KEY] = share
    config.stash[INPUT_STASH] = {"path": share.path, "owner": share.owner_pid, "workers": count(config),
                                 "slots": slots_for(settings, count(config))}
    config.stash[OUTPUTS_KEY] = []
    config.pluginmanager.register(ControllerHooks(config), "ltconform-xdist-controller")


def cores_line(config: pytest.Config) -> str | None:
    """The controller's header line: how many rank processes run at once on how many CPUs."""
    given = config.stash.get(INPUT_STASH, None)
    if given is None:
        return None
    settings = config.stash[controller.SETTINGS_KEY]
    n, ranks, cpus, slots = given["workers"], settings.world_size, settings_mod.cpu_count(), given["slots"]
    if slots is None:
        return (f"ltconform: {n} pytest-xdist workers may each run a world of {ranks} ranks at once: up to "
                f"{n * ranks} rank processes on {cpus} CPUs (--ltconform-oversubscribe)")
    at_once = min(slots, n)
    worlds = "one world at a time" if at_once == 1 else f"at most {at_once} worlds at a time"
    return (f"ltconform: {n} pytest-xdist workers share {cpus} CPUs: {worlds} of {ranks} ranks, at most "
            f"{at_once * ranks} rank processes at once; each run is made once, by one worker, for all of them")


def publish(config: pytest.Config, problems: str | None) -> None:
    """A worker's part once its targets are validated (``problems``: the usage error, if any):
    the header lines and report facts, written once for the controller."""
    share, _ = controller.shared(config)
    if share is None:
        return

    def facts() -> dict:
        if problems is not None:
            return {"problems": problems, "header": [], "not_run": [], "targets": []}
        from . import header, report, results

        targets = config.stash.get(controller.ALL_TARGETS_KEY, {}).values()
        return {"problems": None, "header": header.header_lines(config) or [], "not_run": results.not_run(config),
                "targets": [report.target_entry(t) for t in targets]}

    share.once(FACTS, facts)


def worker_output(config: pytest.Config) -> None:
    """A worker's part at its end: what its sessions made, for the controller's JSON report."""
    if controller.shared(config)[0] is None:
        return
    pool = config.stash.get(controller.POOL_KEY, None)
    config.workeroutput[OUTPUT_KEY] = {"cold_starts": pool.cold_starts if pool is not None else 0,
                                       "imports": pool.imports if pool is not None else 0,
                                       "runs": controller.made_runs(config)}


def gather(config: pytest.Config) -> None:
    """The controller's part at the end: what the workers' sessions made, for the JSON report
    (``controller.XDIST_REPORT_KEY``): the targets, the tiers not run, the worlds started, the
    fork parents' imports and every run made, by whichever worker."""
    share = config.stash.get(controller.SHARE_KEY, None)
    if share is None or hasattr(config, "workerinput"):
        return
    found, facts = share.peek(FACTS)
    outputs = config.stash.get(OUTPUTS_KEY, [])
    config.stash[controller.XDIST_REPORT_KEY] = {
        "targets": facts["targets"] if found else [], "not_run": facts["not_run"] if found else [],
        "cold_starts": sum(o["cold_starts"] for o in outputs), "imports": sum(o["imports"] for o in outputs),
        "runs": [r for o in outputs for r in o["runs"]]}


def close(config: pytest.Config) -> None:
    """The controller removes the session folder (every worker has ended)."""
    share = config.stash.get(controller.SHARE_KEY, None)
    if share is not None and not hasattr(config, "workerinput"):
        shutil.rmtree(share.path, ignore_errors=True)


_NONE = object()  # no target chosen yet (None is the user's own tests)


def target_of(nodeid: str) -> str | None:
    """The target whose runs an item needs (``ltconform::<target id>::<item>``); None for any other test."""
    if not nodeid.startswith("ltconform::"):
        return None
    return nodeid.rsplit("::", 1)[0]


def affinity_scheduler(config: pytest.Config, log, slots: int | None):
    """xdist's ``load`` scheduler, dealing each worker the items of the target it already works on.

    Under ``--dist load`` the items go to the workers that are free, in chunks; this changes only
    which pending items fill a worker's next chunk (xdist takes the first ones): the items of the
    target the worker was last given while any are pending, else of a target no other worker is
    on, else (only where the machine holds more than one world at once: ``slots``, see
    :func:`slots_for`) of another worker's target. A worker then starts each target's ranks once,
    and where the machine runs one world at a time a worker with no target of its own waits
    instead of starting a second world of a target another worker is on, which would run its jobs
    only in turn with that worker's, after a start of its own (a run is made once either way).
    Items of no target (the user's own tests) go to any free worker, first come."""
    from xdist.scheduler import LoadScheduling

    share_targets = slots is None or slots > 1

    class TargetAffinityScheduling(LoadScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.node_target: dict = {}  # node -> the target of the last item sent to it

        def _pick(self, node, num: int) -> list[int]:
            targets = [target_of(self.collection[i]) for i in self.pending]
            taken = {t for n, t in self.node_target.items() if n is not node and n in self.node2pending}
            own = self.node_target.get(node, _NONE)
            if own is _NONE or own not in targets:  # a target of no other worker's, or the user's own tests
                own = next((t for t in targets if t is None or t not in taken), _NONE)
            if own is _NONE:
                if not share_targets:
                    return []  # every pending target is another worker's: wait, or shut down at the end
                own = targets[0]
            chosen = [i for i, t in zip(self.pending, targets) if t == own][:num]
            left = set(chosen)
            chosen += [i for i, t in zip(self.pending, targets)
                       if i not in left and (t is None or share_targets or t not in taken)][:num - len(chosen)]
            return chosen

        def _send_tests(self, node, num: int) -> None:
            chosen = self._pick(node, num) if num > 0 and self.pending else []
            if not chosen:
                return
            self.node_target[node] = target_of(self.collection[chosen[0]])
            picked = set(chosen)
            self.pending[:] = [i for i in self.pending if i not in picked]
            self.node2pending[node].extend(chosen)
            node.send_runtest_some(chosen)

    return TargetAffinityScheduling(config, log)


class ControllerHooks:
    """The xdist controller's hooks (registered only there, where xdist's hooks exist)."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.said = False

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_make_scheduler(self, config, log):
        """``--dist load`` (xdist's default with -n) keeps a worker on its target (see
        :func:`affinity_scheduler`); other modes, and a scheduler of the user's own (a conftest's or
        another plugin's hook: this one is called before them), are left as they are."""
        if config.getoption("dist", None) != "load":
            return None
        hook = config.pluginmanager.hook.pytest_xdist_make_scheduler
        if any(impl.plugin is not self and impl.plugin_name != "dsession" for impl in hook.get_hookimpls()):
            return None  # the user's own scheduler decides
        return affinity_scheduler(config, log, self.config.stash[INPUT_STASH]["slots"])

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node) -> None:
        node.workerinput[controller.SHARE_INPUT] = self.config.stash[INPUT_STASH]

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodeready(self, node) -> None:
        """The first worker ready has validated the targets: say what a serial session's header
        says of them, or stop with the usage error every worker got."""
        if self.said:
            return
        self.said = True
        found, facts = self.config.stash[controller.SHARE_KEY].peek(FACTS)
        if not found:
            return
        if facts["problems"]:
            pytest.exit(f"ERROR: {facts['problems']}", returncode=pytest.ExitCode.USAGE_ERROR)
        from . import header

        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        printed = set(header.header_lines(self.config) or [])
        for line in facts["header"]:
            if reporter is not None and line not in printed:
                reporter.write_line(line)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        output = getattr(node, "workeroutput", {}).get(OUTPUT_KEY)
        if output is not None:
            self.config.stash[OUTPUTS_KEY].append(output)
