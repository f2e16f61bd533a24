"""pytest-xdist as users run it (``pytest -n N --ltconform X``): each run is made once,
by one worker, whichever workers hold its items; its failure is reported once; the controller
imports neither torch nor Lightning; the workers' ranks share one fork parent and the machine's
cores. (The project's own suite runs on xdist too, with its own scheduler: that is not this.)
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import Counter

import pytest

pytest_plugins = ["pytester"]


# -- the session folder (world.share), no world ----------------------------------------------------
def test_a_value_is_made_once_across_the_workers_and_a_failed_making_leaves_it_unmade(tmp_path):
    from pytest_ltconform.world.share import SessionShare

    first, second = SessionShare(str(tmp_path), os.getpid()), SessionShare(str(tmp_path), os.getpid())
    made = []
    assert second.peek("run") == (False, None)
    with pytest.raises(RuntimeError):
        first.once("run", lambda: (_ for _ in ()).throw(RuntimeError("the maker died")))
    assert second.peek("run") == (False, None)  # not made: the next asker makes it
    assert first.once("run", lambda: made.append("first") or {"by": "first"}) == {"by": "first"}
    assert second.once("run", lambda: made.append("second") or {"by": "second"}) == {"by": "first"}
    assert made == ["first"] and second.peek("run") == (True, {"by": "first"})
    assert second.names("ru") == ["run"] and second.names("other") == []


def test_a_worker_asking_while_another_makes_the_value_waits_for_it(tmp_path):
    from pytest_ltconform.world.share import SessionShare

    first, second = SessionShare(str(tmp_path), os.getpid()), SessionShare(str(tmp_path), os.getpid())
    started, order = threading.Event(), []

    def slow():
        started.set()
        time.sleep(0.3)
        order.append("made")
        return 1

    maker = threading.Thread(target=lambda: first.once("run", slow))
    maker.start()
    started.wait(10)
    got = second.once("run", lambda: order.append("made twice") or 2)
    order.append("read")
    maker.join(10)
    assert (got, order) == (1, ["made", "read"])


def test_world_slots_bound_the_worlds_running_at_once(tmp_path):
    from pytest_ltconform.world.share import SessionShare

    share = SessionShare(str(tmp_path), os.getpid())
    order = []
    with share.slot(1):
        waiter = threading.Thread(target=lambda: _take(share, order))
        waiter.start()
        time.sleep(0.3)  # time for the waiter to take the slot, were it free
        order.append("released")
    waiter.join(10)
    assert order == ["released", "taken"]
    with share.slot(2), share.slot(2):  # two slots: two holders at once
        order.append("both")
    assert order[-1] == "both"


def _take(share, order):
    with share.slot(1):
        order.append("taken")


def test_the_machine_is_counted_once_for_every_worker():
    from pytest_ltconform import settings as settings_mod
    from pytest_ltconform.settings import Settings, check_capacity
    from pytest_ltconform.workers import slots_for

    two = Settings(target="m:Model", world_size=2)
    assert slots_for(two, workers=4) == max(1, settings_mod.cpu_count() // 2)
    assert slots_for(Settings(target="m:Model", world_size=2, oversubscribe=True), workers=4) is None
    check_capacity(two, cpus=2, memory_mb=4 * 2 * settings_mod.RANK_MEMORY_MB, workers=4)  # fits: no error
    with pytest.raises(pytest.UsageError, match=r"4 pytest-xdist workers' worlds of 2 ranks need about .*fewer "
                                                r"workers \(-n\)"):
        check_capacity(two, cpus=2, memory_mb=4 * 2 * settings_mod.RANK_MEMORY_MB - 1, workers=4)
    with pytest.raises(pytest.UsageError, match="a world of 4 ranks needs 4 CPUs"):
        check_capacity(Settings(target="m:Model", world_size=4), cpus=2, memory_mb=10**6, workers=2)


# -- users' sessions under -n ------------------------------------------------------------------------
COUNTED = '''
import os

from lightning.pytorch.demos.boring_classes import BoringModel


class Model(BoringModel):
    def on_fit_start(self):
        with open(os.environ["FITS_LOG"], "a") as fh:  # one line per rank of every fit made
            fh.write(f"{self.global_rank}\\n")

    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise ZeroDivisionError("the user's own bug")
        return super().training_step(batch, batch_idx)
'''

HEAVY_IN_PYTEST = """
import os
import sys


import pytest


@pytest.hookimpl(optionalhook=True)  # a user's own scheduler: xdist's load, chunks of any items
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScheduling

    return LoadScheduling(config, log)


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):  # the controller
        print("CONTROLLER IMPORTED:", ", ".join(sorted({"torch", "lightning"} & set(sys.modules))) or "nothing",
              file=sys.stderr)
"""


def _session(pytester, monkeypatch, name: str, *mode: str):
    log = pytester.path / f"{name}.fits"
    monkeypatch.setenv("FITS_LOG", str(log))
    report = pytester.path / f"{name}.json"
    result = pytester.runpytest_subprocess("--ltconform", "counted.Model", "--ltconform-strategies", "ddp",
                                           "--ltconform-nodes", "1",
                                           "--ltconform-report", str(report), "-p", "no:cacheprovider",
                                           "-p", "no:randomly", "-v", "-rA", *mode)
    fits = log.read_text().split() if log.exists() else []
    return result, json.loads(report.read_text()), Counter(fits)


def test_a_failing_run_under_dist_load_is_made_once_and_reported_once(pytester, monkeypatch, no_leftover_ranks):
    """The fit's items land on both workers (xdist's own load scheduler, which a conftest asks
    for: the plugin's target affinity steps aside), yet the fit is made once, by one worker (as
    many fits as a serial session makes, counted by the module itself), and its failure is
    reported once, on the run's item, which every other item names."""
    pytester.makepyfile(counted=COUNTED)
    pytester.makeconftest(HEAVY_IN_PYTEST)
    serial, serial_doc, serial_fits = _session(pytester, monkeypatch, "serial", "-p", "no:xdist")
    result, doc, fits = _session(pytester, monkeypatch, "xdist", "-n", "2", "--dist", "load")
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out[-3000:]
    # The premise: the fit run's items ran on both workers (else nothing was shared).
    fit_items = re.findall(r"\[(gw\d)\] \[\s*\d+%\] (?:PASSED|FAILED|SKIPPED) ltconform::counted.Model::"
                           r"(fit|sync-dist|all-rank-save|unused-parameters|data-sharding)\[ddp\]", out)
    assert {gw for gw, _ in fit_items} == {"gw0", "gw1"}, fit_items
    # Made once: the module saw as many fits as in the serial session, and the report lists each run once.
    assert serial_fits and fits == serial_fits, (fits, serial_fits)
    keys = [(r["target"], r["kind"], r["strategy"], r["tier"]) for r in doc["runs"]]
    assert len(keys) == len(set(keys)) and sorted(keys) == sorted(
        (r["target"], r["kind"], r["strategy"], r["tier"]) for r in serial_doc["runs"]), (keys, serial_doc["runs"])
    assert keys.count(("counted.Model", "fit", "ddp", "cpu")) == 1
    assert doc["imports"] == 1, doc["imports"]  # one fork parent for both workers
    # Reported once: one failed item, the run's, with the rank's exception; the others point at it.
    assert result.parseoutcomes()["failed"] == 1 and serial.parseoutcomes() == result.parseoutcomes(), \
        (serial.parseoutcomes(), result.parseoutcomes())
    result.stdout.fnmatch_lines(["*FAILED ltconform::counted.Model::fit[[]ddp[]]*"])
    assert out.count("raise ZeroDivisionError(\"the user's own bug\")") == 1, out[-5000:]
    for contract in ("all-rank-save", "sync-dist"):
        result.stdout.fnmatch_lines([f"SKIPPED*ltconform::counted.Model::{contract}[[]ddp[]]*not judged*"
                                     f"(see fit[[]ddp[]])*"])
    # The header counts the workers' ranks on the machine's cores; the controller imported nothing heavy.
    result.stdout.fnmatch_lines(["ltconform: 2 pytest-xdist workers share * CPUs: *"])
    result.stderr.fnmatch_lines(["CONTROLLER IMPORTED: nothing"])
    def verdicts(d):
        return sorted((r["contract"], r["strategy"], r["outcome"]) for r in d["results"])

    assert verdicts(doc) == verdicts(serial_doc)


def test_a_bad_target_under_n_stops_the_session_once_with_the_error(pytester):
    """One worker validates the target; the controller says its usage error once, as a serial
    session does, and the session stops (no worker restarted, no item run)."""
    pytester.makepyfile(broken="def factory():\n    raise ValueError('checkpoint path not set')\n")
    result = pytester.runpytest_subprocess("--ltconform", "broken:factory", "-n", "2", "-p", "no:cacheprovider")
    out = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR, out[-3000:]
    assert out.count("calling factory() raised ValueError: checkpoint path not set") == 1, out[-3000:]
    assert "INTERNALERROR" not in out and "replacing crashed worker" not in out, out[-3000:]


def test_under_dist_load_each_worker_keeps_to_its_target(pytester, no_leftover_ranks):
    """xdist's default mode with the plugin's scheduler: on a machine that holds one world at a
    time (slots), each target's items run on one worker, so each target's ranks start once."""
    from pytest_ltconform import settings as settings_mod

    if settings_mod.cpu_count() // 2 > 1:
        pytest.skip("this machine holds more than one world of 2 ranks at once: workers may share a target")
    boring = "lightning.pytorch.demos.boring_classes.BoringModel"

    def session(name, *mode):
        report = pytester.path / f"{name}.json"
        result = pytester.runpytest_subprocess("--ltconform", f"{boring} id=a", "--ltconform", f"{boring} id=b",
                                               "--ltconform-strategies", "ddp", "--ltconform-nodes", "1",
                                               "-k", "sync-dist or eval-duplication",
                                               "--ltconform-report", str(report), "-v", "-p", "no:cacheprovider",
                                               "-p", "no:randomly", *mode)
        assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
        return result.stdout.str(), json.loads(report.read_text())

    _, serial = session("serial", "-p", "no:xdist")
    out, doc = session("xdist", "-n", "2")
    ran = re.findall(r"\[(gw\d)\] \[\s*\d+%\] \w+ ltconform::(a|b)::", out)
    workers = {t: {gw for gw, tt in ran if tt == t} for t in ("a", "b")}
    assert len(ran) == 4 and all(len(w) == 1 for w in workers.values()), ran  # sync-dist, eval-duplication each
    assert workers["a"] != workers["b"], ran
    # Each target's ranks started as often as in a serial session, each run made once.
    assert (doc["cold_starts"], len(doc["runs"])) == (serial["cold_starts"], len(serial["runs"])), (doc, serial)


class _Config:
    def __init__(self, workers: int):
        self.values = {"tx": [f"{workers}*popen"], "maxschedchunk": None}

    def getvalue(self, name):
        return self.values[name]

    getoption = getvalue


class _Node:
    def __init__(self, name: str):
        self.name, self.got, self.shutting_down = name, [], False
        self.gateway = type("Gateway", (), {"id": name})()

    def send_runtest_some(self, indices):
        self.got.extend(indices)

    def shutdown(self):
        self.shutting_down = True


def _dealt(slots, collection, workers=2):
    """Which items each worker is dealt when each finishes its items one at a time, in turn."""
    from pytest_ltconform.workers import affinity_scheduler

    quiet = type("Log", (), {"loadsched": staticmethod(lambda *args: None)})()
    sched = affinity_scheduler(_Config(workers), quiet, slots)
    nodes = [_Node(f"gw{n}") for n in range(workers)]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    while sched.pending or any(sched.node2pending.values()):
        busy = [n for n in nodes if sched.node2pending[n]]
        if not busy:
            break
        for node in busy:
            sched.mark_test_complete(node, sched.node2pending[node][0])
    return {n.name: [collection[i] for i in n.got] for n in nodes}, sched.pending


def test_the_load_scheduler_keeps_a_worker_on_its_target():
    collection = [f"ltconform::{t}::{c}[ddp]" for t in ("t1", "t2", "t3") for c in "abcdefgh"] + ["test_own.py::x"]
    dealt, left = _dealt(1, collection)
    assert left == [] and sorted(sum(dealt.values(), [])) == sorted(collection)  # every item, once
    by_target = {t: {w for w, items in dealt.items() if any(f"::{t}::" in i for i in items)}
                 for t in ("t1", "t2", "t3")}
    # One world at a time: no target is split between workers (one waits instead).
    assert all(len(w) == 1 for w in by_target.values()), dealt
    assert by_target["t1"] != by_target["t2"], dealt
    # Several worlds at once: a free worker joins another's target rather than wait.
    dealt, left = _dealt(2, collection)
    assert left == [] and sorted(sum(dealt.values(), [])) == sorted(collection)
    assert {w for w, items in dealt.items() if any("::t3::" in i for i in items)} == {"gw0", "gw1"}, dealt


# -- the other --dist modes: each run made once, each item reported once, the report complete -------
PER_RANK_COUNTED = '''
import os

from lightning.pytorch.demos.boring_classes import BoringModel


class Model(BoringModel):
    def on_fit_start(self):
        with open(f"{os.environ['FITS_LOG']}.{self.global_rank}", "a") as fh:  # each rank its own file
            fh.write("fit\\n")
'''


def _counted_session(pytester, monkeypatch, name: str, *mode: str):
    log = pytester.path / f"{name}.fits"
    monkeypatch.setenv("FITS_LOG", str(log))
    report = pytester.path / f"{name}.json"
    result = pytester.runpytest_subprocess("--ltconform", "per_rank.Model", "--ltconform-strategies", "ddp",
                                           "--ltconform-nodes", "1", "--ltconform-report", str(report),
                                           "-p", "no:cacheprovider", "-p", "no:randomly", "-v", *mode)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
    fits = {r: len((pytester.path / f"{name}.fits.{r}").read_text().split()) for r in (0, 1)}
    return result, json.loads(report.read_text()), fits


@pytest.mark.parametrize("dist", ["each", "loadfile", "worksteal"])
def test_each_dist_mode_makes_each_run_once_and_reports_each_item_once(pytester, monkeypatch, dist,
                                                                      no_leftover_ranks):
    """Under -n 2 with --dist each / loadfile / worksteal, the fits the module saw, the runs the
    report lists and its verdicts are the serial session's; each item has one record and one
    summary line (under each, pytest's own counts are doubled: every worker runs every item)."""
    pytester.makepyfile(per_rank=PER_RANK_COUNTED)
    serial, serial_doc, serial_fits = _counted_session(pytester, monkeypatch, "serial", "-p", "no:xdist")
    result, doc, fits = _counted_session(pytester, monkeypatch, dist, "-n", "2", "--dist", dist)
    assert serial_fits[0] > 0 and fits == serial_fits, (fits, serial_fits)  # made once

    def keys(d):
        return sorted((r["target"], r["kind"], r["strategy"], r["tier"]) for r in d["runs"])

    assert keys(doc) == keys(serial_doc) and len(set(keys(doc))) == len(keys(doc)), (doc["runs"], serial_doc["runs"])

    def verdicts(d):
        return sorted((r["contract"], r["strategy"], r["outcome"]) for r in d["results"])

    assert verdicts(doc) == verdicts(serial_doc), (verdicts(doc), verdicts(serial_doc))  # complete, once each
    times = 2 if dist == "each" else 1
    assert result.parseoutcomes() == {k: v * times for k, v in serial.parseoutcomes().items()}, \
        (result.parseoutcomes(), serial.parseoutcomes())
    summary = result.stdout.str().split("ltconform summary", 1)[1]
    assert summary.count("memory[ddp]: ") == 1, summary[:3000]  # the advisory, once in the summary
