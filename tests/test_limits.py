"""Limits that hold: machine capacity, report path, timeouts, SIGTERM, stale world folders, the
one-line reason of passed items, and the contract pages that ship in the package.

Start-up checks run pytest in-process (they stop before any world starts); anything that starts
ranks or sends signals runs pytest in a subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import BORING, REPO, rank_pids, wait_until

from pytest_ltconform import settings as settings_mod

pytest_plugins = ["pytester"]


@pytest.fixture(scope="module", autouse=True)
def _lightning_loaded():
    """In-process runs validate BoringModel: import it once here, before pytester's snapshot of
    sys.modules, so that no run removes torch from sys.modules (torch cannot be imported twice)."""
    import lightning.pytorch.demos.boring_classes  # noqa: F401


# -- 1. world size against CPUs and memory ---------------------------------------------------------

def test_capacity_check_names_the_count_and_the_fix():
    too_many = settings_mod.Settings(target="m.M", world_size=3, world_size_from="--ltconform-world-size")
    with pytest.raises(pytest.UsageError) as info:
        settings_mod.check_capacity(too_many, cpus=2, memory_mb=100_000)
    assert str(info.value) == (
        "--ltconform-world-size: a world of 3 ranks needs 3 CPUs, but this machine gives pytest 2; ranks that "
        "share CPUs make healthy collectives time out. Use --ltconform-world-size 2 or fewer, or add "
        "--ltconform-oversubscribe to start them anyway.")
    with pytest.raises(pytest.UsageError) as info:
        settings_mod.check_capacity(settings_mod.Settings(target="m.M", world_size=4), cpus=8, memory_mb=2048)
    assert str(info.value).startswith("--ltconform-world-size (default 2): a world of 4 ranks needs about 2.3 GB "
                                      "(600 MB per rank for torch and Lightning), but 2.0 GB is available")
    settings_mod.check_capacity(settings_mod.Settings(target="m.M", world_size=4), cpus=4, memory_mb=2400)
    oversubscribed = settings_mod.Settings(target="m.M", world_size=64, oversubscribe=True)
    settings_mod.check_capacity(oversubscribed, cpus=2, memory_mb=1000)


def test_machine_facts_are_read():
    assert settings_mod.cpu_count() == len(os.sched_getaffinity(0))
    with open("/proc/meminfo") as fh:
        kb = next(int(line.split()[1]) for line in fh if line.startswith("MemAvailable:"))
    assert abs(settings_mod.available_memory_mb() - kb // 1024) < 512  # it moves while we read


def test_world_larger_than_the_machine_is_refused_at_start(pytester, monkeypatch):
    monkeypatch.setattr(settings_mod, "cpu_count", lambda: 1)
    result = pytester.runpytest("--ltconform", BORING, "--ltconform-world-size", "2", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --ltconform-world-size: a world of 2 ranks needs 2 CPUs, but this machine "
                                 "gives pytest 1; ranks that share CPUs make healthy collectives time out. Add "
                                 "--ltconform-oversubscribe to start them anyway."])
    pytester.makeini("[pytest]\nltconform_world_size = 3\n")
    result = pytester.runpytest("--ltconform", BORING, "-p", "no:cacheprovider")
    result.stderr.fnmatch_lines(["ERROR: ini option 'ltconform_world_size' in *: a world of 3 ranks needs 3 CPUs*"])
    monkeypatch.setattr(settings_mod, "cpu_count", lambda: 64)
    monkeypatch.setattr(settings_mod, "available_memory_mb", lambda: 1000)
    result = pytester.runpytest("--ltconform", BORING, "-p", "no:cacheprovider")
    result.stderr.fnmatch_lines(["ERROR: ini option 'ltconform_world_size' in *: a world of 3 ranks needs about "
                                 "1.8 GB (600 MB per rank for torch and Lightning), but 1.0 GB is available*"])


@pytest.mark.parametrize("how", ["flag", "ini"])
def test_oversubscribe_lets_a_large_world_through(pytester, monkeypatch, how):
    monkeypatch.setattr(settings_mod, "cpu_count", lambda: 1)
    monkeypatch.setattr(settings_mod, "available_memory_mb", lambda: 100)
    args = ["--ltconform", BORING, "--ltconform-world-size", "8", "--collect-only", "-q", "-p", "no:cacheprovider"]
    if how == "flag":
        args.append("--ltconform-oversubscribe")
    else:
        pytester.makeini("[pytest]\nltconform_oversubscribe = true\n")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.OK, result.stderr.str()
    result.stdout.fnmatch_lines([f"ltconform::{BORING}::sync-dist[[]ddp[]]"])


# -- 2. the report path ----------------------------------------------------------------------------

def test_unwritable_report_path_fails_at_start_in_one_line(pytester):
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    (pytester.path / "a_file").write_text("")
    (pytester.path / "a_dir").mkdir()
    cases = [
        (pytester.path / "a_dir", "*cannot write the JSON report to */a_dir: it is a directory; name a file, "
                                  "e.g. */a_dir/ltconform.json."),
        (pytester.path / "a_file" / "out" / "r.json", "*cannot write the JSON report to */a_file/out/r.json: "
                                                      "*/a_file is a file, not a folder; choose another path."),
        (pytester.path / "a_file" / "r.json", "*cannot write the JSON report to */a_file/r.json: "
                                              "*/a_file is a file, not a folder; choose another path."),
        ("/proc/ltconform-nowhere/r.json", "*cannot write the JSON report to /proc/ltconform-nowhere/r.json: "
                                           "* (in /proc/ltconform-nowhere); choose a path in a folder you can "
                                           "write to."),
    ]
    for path, message in cases:
        result = pytester.runpytest("--ltconform-report", str(path), "-p", "no:cacheprovider")
        assert result.ret == pytest.ExitCode.USAGE_ERROR, path
        result.stderr.fnmatch_lines(["ERROR: --ltconform-report: " + message.lstrip("*")])
        assert "Traceback" not in result.stderr.str() and "passed" not in result.stdout.str()


def test_existing_report_is_untouched_until_the_end(pytester):
    report = pytester.path / "r.json"
    report.write_text("old")
    pytester.makepyfile(test_x="def test_x():\n    assert open('r.json').read() == 'old'\n")
    result = pytester.runpytest("--ltconform-report", str(report), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    # Nothing was judged (no contract item ran), so the earlier report is kept, and the terminal says so.
    assert report.read_text() == "old"
    result.stdout.fnmatch_lines([f"ltconform: nothing was judged, so the JSON report {report} was left as an "
                                 f"earlier session wrote it"])


RECORDING = '''
import json, os, shutil

def _rec(contract, outcome):
    return json.dumps({"contract": contract, "strategy": "ddp", "world_size": 2, "outcome": outcome,
                       "message": "m", "summary": "s", "evidence": [], "duration_s": 1.0})

def test_records(record_property):
    record_property("ltconform", _rec("sync-dist", "passed"))

def test_breaks_the_report_folder():
    shutil.rmtree("out")
    open("out", "w").close()  # the report's folder is now a file
'''


def test_report_write_failure_at_the_end_keeps_the_summary(pytester):
    (pytester.path / "out").mkdir()
    pytester.makepyfile(test_rec=RECORDING)
    result = pytester.runpytest("--ltconform-report", "out/r.json", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # a job that keeps the report must not pass without it
    result.stdout.fnmatch_lines([
        "*ltconform summary*", "*sync-dist*passed*",
        "pytest-ltconform: could not write the JSON report to */out/r.json: * (errno *); the session fails, and the "
        "verdicts are in the summary above.",
    ])
    assert "Traceback" not in result.stdout.str()


# -- 4. timeouts -----------------------------------------------------------------------------------

@pytest.mark.parametrize("ini, args, where", [
    ("", ["--ltconform-timeout", "5"], "--ltconform-timeout"),
    ("ltconform_timeout = 9.5", [], "ini option 'ltconform_timeout' in *"),
])
def test_timeout_below_a_run_is_refused_with_the_minimum(pytester, ini, args, where):
    pytester.makeini(f"[pytest]\n{ini}\n")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    value = args[1] if args else "9.5"
    result.stderr.fnmatch_lines([f"ERROR: {where}: {value} s is shorter than a contract run can take; the minimum "
                                 f"is 10 s (*"])
    assert settings_mod.MIN_TIMEOUT_S == 10.0


def test_timeout_kill_names_the_option_and_its_value():
    from pytest_ltconform.world import JobResult, RankOutcome

    ranks = [RankOutcome(rank=0, status="hung"), RankOutcome(rank=1, status="hung")]
    result = JobResult.of(ranks, 12.04, timeout_s=12, timed_out_by="--ltconform-timeout=12")
    assert result.diagnosis.splitlines()[0] == (
        "The world did not finish: rank(s) 0, 1 were still running after 12.0 s and were killed (SIGKILL) at the "
        "time limit (--ltconform-timeout=12; raise it if the run is only slow).")
    untimed = JobResult.of(ranks, 12.04, timeout_s=12)
    assert untimed.diagnosis.splitlines()[0].endswith("were killed (SIGKILL).")


SLEEPERS = '''
def sleep_everywhere(ctx):
    import time
    time.sleep(600)

def test_sleeps(ltconform_world):
    ltconform_world(world_size=2).run(sleep_everywhere)
'''


def test_world_killed_at_the_timeout_says_so(pytester, monkeypatch, no_leftover_ranks):
    monkeypatch.setenv("LTCONFORM_PRELOAD", "torch")  # machinery: its ranks need no Lightning
    pytester.makepyfile(test_sleep=SLEEPERS)
    result = pytester.runpytest_subprocess("--ltconform-timeout", "10", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rank(s) 0, 1 were still running after 1?.? s and were killed (SIGKILL) at the "
                                 "time limit (--ltconform-timeout=10; raise it if the run is only slow)."])


# -- 3. SIGTERM and folders left by SIGKILL --------------------------------------------------------

SIGTERMED = RECORDING.split("def test_breaks")[0] + '''
def sleep_everywhere(ctx):
    import time
    time.sleep(600)

def test_sleeps(ltconform_world):
    ltconform_world(world_size=2).run(sleep_everywhere)
'''


def _worlds(tmp) -> list[str]:
    return [n for n in os.listdir(tmp) if n.startswith("ltconform-world-")]


def test_sigterm_ends_the_session_like_ctrl_c(pytester, monkeypatch, no_leftover_ranks):
    tmp = pytester.path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setenv("LTCONFORM_PRELOAD", "torch")
    pytester.makepyfile(test_term=SIGTERMED)
    out = pytester.path / "stdout.txt"
    with open(out, "w") as fh:
        proc = pytester.popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--ltconform-report",
                               "r.json", "--ltconform-timeout", "300"], stdout=fh, stderr=subprocess.STDOUT)
        try:
            assert wait_until(lambda: len(rank_pids(proc.pid)) == 2, 90), "ranks never started"
            assert len(_worlds(tmp)) == 1
            time.sleep(1.0)
            os.kill(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=60) == pytest.ExitCode.INTERRUPTED
        finally:
            if proc.poll() is None:
                proc.kill()
    text = out.read_text()
    assert "pytest-ltconform: SIGTERM received; stopped the ranks, reporting what finished" in text, text[-3000:]
    assert "ltconform summary" in text and "Traceback" not in text, text[-3000:]
    doc = json.loads((pytester.path / "r.json").read_text())
    assert [r["contract"] for r in doc["results"]] == ["sync-dist"]
    assert wait_until(lambda: not rank_pids(proc.pid, parents=True), 15)
    assert _worlds(tmp) == []


def test_folders_of_a_killed_session_are_removed_at_the_next_start(pytester, monkeypatch, no_leftover_ranks):
    from pytest_ltconform.world import remove_stale_worlds

    tmp = pytester.path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setenv("LTCONFORM_PRELOAD", "torch")
    pytester.makepyfile(test_sleep=SLEEPERS)
    proc = pytester.popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--ltconform-timeout", "300"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: len(rank_pids(proc.pid)) == 2, 90), "ranks never started"
        live = _worlds(tmp)
        assert len(live) == 1 and remove_stale_worlds(str(tmp)) == []  # its owner lives: untouched
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _worlds(tmp) == live  # SIGKILL runs no clean-up
    assert wait_until(lambda: not rank_pids(proc.pid, parents=True), 15)
    assert remove_stale_worlds(str(tmp)) == [str(tmp / live[0])]
    assert _worlds(tmp) == []


def test_stale_world_sweep_spares_live_owners_and_unknown_folders(tmp_path):
    from pytest_ltconform.world import LocalWorld, remove_stale_worlds

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / "ltconform-world-dead"
    dead.mkdir()
    (dead / "owner").write_text(f"{gone.pid} 1\n")
    reused = tmp_path / "ltconform-world-reused"  # our pid, but another start time: a reused pid
    reused.mkdir()
    (reused / "owner").write_text(f"{os.getpid()} 1\n")
    no_owner = tmp_path / "ltconform-world-noowner"
    no_owner.mkdir()
    other = tmp_path / "not-a-world"
    other.mkdir()
    (other / "owner").write_text(f"{gone.pid} 1\n")
    live = LocalWorld(2, root=None)  # made by this process: its owner lives
    try:
        os.replace(live.root, tmp_path / "ltconform-world-live")
        removed = remove_stale_worlds(str(tmp_path))
        assert sorted(removed) == sorted([str(dead), str(reused)])
        assert sorted(os.listdir(tmp_path)) == ["ltconform-world-live", "ltconform-world-noowner", "not-a-world"]
    finally:
        live.close()


# -- 5. the one-line reason of passed items --------------------------------------------------------

FAKE_SESSION = '''
import pytest
from pytest_ltconform.controller import ALL_TARGETS_KEY, SESSIONS_KEY, SETTINGS_KEY

class FakeSession:
    """Every contract passes with a reason naming it, and no world starts."""
    attached = None

    def __init__(self, settings):
        self.settings = settings

    def verdict(self, contract_id, strategy, tier="cpu"):
        from pytest_ltconform import contracts
        return contracts.get_contract(contract_id).verdict("passed", f"checked {contract_id} under {strategy}."), 0.1

@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    config.stash[SESSIONS_KEY] = {tid: FakeSession(config.stash[SETTINGS_KEY]) for tid in config.stash[ALL_TARGETS_KEY]}
'''


@pytest.mark.parametrize("flag", ["-rA", "-v", "-vv"])
def test_passed_items_show_what_they_checked(pytester, monkeypatch, flag):
    monkeypatch.setenv("COLUMNS", "160")  # the item id carries the target's long name; pytest trims at the width
    pytester.makeconftest(FAKE_SESSION)
    result = pytester.runpytest("--ltconform", BORING, "--ltconform-strategies", "ddp", "-m", "ltconform_cpu",
                                "--ltconform-oversubscribe", "-p", "no:cacheprovider", flag)
    assert result.parseoutcomes().get("passed", 0) >= 2, result.stdout.str()
    if flag == "-rA":
        # PASSES: the line in full, then the rest of the verdict (the Rule line here) in a section.
        result.stdout.fnmatch_lines(["*= PASSES =*", f"*_ ltconform {BORING}::sync-dist[[]ddp[]] _*",
                                     "checked sync-dist under ddp.", "*- ltconform -*",
                                     "Rule: pytest --ltconform-explain sync-dist *",
                                     f"PASSED ltconform::{BORING}::sync-dist[[]ddp[]] - checked sync-dist under ddp."])
    elif flag == "-v":
        result.stdout.fnmatch_lines([f"ltconform::{BORING}::sync-dist[[]ddp[]] PASSED*",
                                     "    checked sync-dist under ddp."])
    else:  # -vv also names the file that defines the module, as pytest does for an inherited test
        result.stdout.fnmatch_lines([f"ltconform::{BORING}::sync-dist[[]ddp[]] <- *lightning/pytorch/demos/"
                                     f"boring_classes.py PASSED*", "    checked sync-dist under ddp."])


# -- 6. contract pages in the package --------------------------------------------------------------

EXIT_PROBE = '''
import atexit, sys
atexit.register(lambda: print("HEAVY", sorted(m for m in ("torch", "lightning") if m in sys.modules)))
'''


def test_explain_prints_the_packaged_page_and_imports_nothing_heavy(pytester):
    pytester.makeconftest(EXIT_PROBE)
    result = pytester.runpytest_subprocess("--ltconform-explain", "sync-dist", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK
    page = (REPO / "src" / "pytest_ltconform" / "contract_docs" / "sync-dist.md").read_text()
    assert result.stdout.str().startswith(page)
    result.stdout.fnmatch_lines(["HEAVY []"])
    bad = pytester.runpytest_subprocess("--ltconform-explain", "sync_dist")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["ERROR: --ltconform-explain: no contract 'sync_dist'. Did you mean 'sync-dist'? "
                              "Choose from all-rank-save, *"])


@pytest.mark.parametrize("asked, close", [("sync_dist", "sync-dist"), ("all-rank-saves", "all-rank-save"),
                                          ("SyncDist", "sync-dist"), ("nothing-like-it", None)])
def test_explain_of_an_unknown_contract_suggests_the_close_id(asked, close):
    from pytest_ltconform import report

    message = report.unknown_contract(asked)
    hint = f" Did you mean {close!r}?" if close else ""
    assert message == f"no contract {asked!r}.{hint} Choose from {', '.join(report.contract_pages())}."


def test_contract_pages_have_one_source_and_rule_lines_point_to_them():
    from pytest_ltconform import contracts

    packaged = REPO / "src" / "pytest_ltconform" / "contract_docs"
    assert (REPO / "docs" / "contracts").resolve() == packaged.resolve()
    assert sorted(p.stem for p in packaged.glob("*.md")) == sorted(contracts.ids())
    rule = contracts.get_contract("sync-dist").verdict("failed", "x", fix="y").render().splitlines()[-1]
    assert rule == ("Rule: pytest --ltconform-explain sync-dist (docs/contracts/sync-dist.md; from the 'Sampling, "
                    "metrics and writes' section of the distributed-training contracts, Lightning 2.6.6)")
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'pytest_ltconform = ["contract_docs/*.md"]' in pyproject
