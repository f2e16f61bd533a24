"""The rank launchers: ranks forked from one parent that imported torch once (``fork``, the
default) and a fresh interpreter per rank (``spawn``, the baseline, ``--ltconform-launcher``).

Worlds start inside pytest subprocesses (a killed or hung world never takes this session down);
they preload torch, never Lightning: these are tests of the machinery, not of a fit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from conftest import wait_until

pytest_plugins = ["pytester"]

FORKED = '''
import gc
import os
import sys
import tempfile

import pytest

from pytest_ltconform.world import JobRequest, LocalWorld, WorldStartError

IMPORTED_IN = os.getpid()  # the process that imported this module: a rank, never the fork parent


def facts(ctx):
    from lightning_utilities.core.rank_zero import rank_zero_only

    return {"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "sid": os.getsid(0),
            "imported_in": IMPORTED_IN, "rank_env": os.environ["RANK"],
            "rank_zero": getattr(rank_zero_only, "rank", None), "path0": sys.path[0], "tmp": tempfile.gettempdir(),
            "torch_preloaded": "torch.distributed" in sys.modules, "frozen": gc.get_freeze_count(),
            "collects": gc.isenabled()}


def die(ctx):
    if ctx.rank == 1:
        os._exit(7)
    return ctx.rank


def test_a_replaced_world_is_a_fork_of_the_same_parent():
    world = LocalWorld(2, preload=("torch.distributed", "reads_rank"))
    try:
        first = world.run(JobRequest("test_forked:facts", timeout_s=120)).values
        parent = world.launcher.pid
        died = world.run(JobRequest("test_forked:die", timeout_s=120))
        second = world.run(JobRequest("test_forked:facts", timeout_s=120)).values
    finally:
        world.close()
    assert [r.status for r in died.ranks] == ["ok", "died"] and died.ranks[1].exit_code == 7
    assert world.cold_starts == 2 and world.launcher.imports == 1  # two generations, one import
    assert {f["pid"] for f in first}.isdisjoint(f["pid"] for f in second)
    for rank, f in enumerate(first + second):
        rank %= 2
        assert f["ppid"] == parent and f["pgid"] == f["sid"] == f["pid"], f  # own session, for killpg
        assert f["imported_in"] == f["pid"], f  # the job's module was imported in the rank
        # What the parent's imports read from the environment is what the rank's would have read.
        assert (f["rank_env"], f["rank_zero"]) == (str(rank), rank), f
        assert f["path0"] == world.root and f["tmp"] == os.path.join(world.root, "tmp") and f["torch_preloaded"], f
        # The parent's imports are frozen (a rank's collections skip them); the rank still collects.
        assert f["frozen"] > 10000 and f["collects"], f


def test_the_spawn_launcher_starts_a_fresh_interpreter_per_rank():
    world = LocalWorld(2, preload=(), launcher="spawn")
    try:
        values = world.run(JobRequest("test_forked:facts", timeout_s=120)).values
    finally:
        world.close()
    assert [v["ppid"] for v in values] == [os.getpid()] * 2 and world.launcher.imports == 2
    assert [(v["path0"], v["rank_zero"], v["torch_preloaded"]) for v in values] == [(world.root, None, True)] * 2


def test_an_unknown_launcher_is_refused():
    with pytest.raises(ValueError, match="unknown rank launcher 'vfork'; choose from fork, spawn"):
        LocalWorld(2, preload=(), launcher="vfork")
'''


def test_forked_ranks_are_what_spawned_ranks_are(pytester):
    """A rank forked from the parent has its own session, environment, rank, folder and temp dir,
    imports the job's module itself, and a world replaced after a rank died costs no import."""
    # As lightning.fabric does when imported: it reads the rank from the environment, once.
    pytester.makepyfile(test_forked=FORKED, reads_rank='''
import os

from lightning_utilities.core.rank_zero import rank_zero_only

rank_zero_only.rank = int(os.environ.get("RANK", 0))
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=3)


UNSAFE = '''
import pytest

from pytest_ltconform.world import JobRequest, LocalWorld, WorldStartError


def rank_of(ctx):
    return ctx.rank


@pytest.mark.parametrize("module, says", [
    ("starts_a_thread", "runs 2 threads after its imports (Python threads: MainThread, left-running)"),
    ("initialises_cuda", "CUDA was initialised while importing the preloaded modules"),
])
@pytest.mark.parametrize("first", [(), ("json",)], ids=["first-step", "second-step"])
def test_a_parent_that_cannot_fork_safely_refuses(module, says, first):
    # The first module is imported before the parent is ready, the others before its first rank.
    world = LocalWorld(2, preload=(*first, module))
    try:
        with pytest.raises(WorldStartError) as info:
            world.run(JobRequest("test_unsafe:rank_of", timeout_s=120))
        with pytest.raises(WorldStartError) as again:  # the next run is told at once, not retried
            world.run(JobRequest("test_unsafe:rank_of", timeout_s=120))
    finally:
        world.close()
    message = str(info.value)
    assert str(again.value) == message and world.launcher.imports == 1
    assert says in message and f"(preloaded: {', '.join((*first, module))})" in message, message
    assert "--ltconform-launcher=spawn" in message, message
    assert world.launcher.pid is None and world._procs == []  # no rank was forked
    assert world.launcher.exits == {}
'''


def test_a_fork_parent_with_a_thread_or_cuda_refuses_with_the_fix(pytester):
    """Forking copies held locks of other threads, and a child of a process that initialised CUDA
    cannot use it: the parent checks both after its imports and refuses, naming the spawn launcher."""
    pytester.makepyfile(test_unsafe=UNSAFE, starts_a_thread='''
import threading
import time

threading.Thread(target=time.sleep, args=(600,), name="left-running", daemon=True).start()
''', initialises_cuda='''
import torch

# What torch.cuda's lazy init leaves once it ran: this CPU machine has no device to initialise.
torch.cuda._initialized = True
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)


SUPERVISOR = '''
import os
import sys
import time

from pytest_ltconform.world import JobRequest, LocalWorld

world = LocalWorld(2, preload=("torch.distributed",), launcher=sys.argv[1])
pids = world.run(JobRequest("jobs:pid", timeout_s=120)).values
print("PIDS", world.launcher.pid if sys.argv[1] == "fork" else 0, *pids, world.root, flush=True)
time.sleep(600)
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


@pytest.mark.parametrize("launcher", ["fork", "spawn"])
def test_sigkill_of_the_supervisor_takes_the_parent_and_its_ranks_down(pytester, launcher):
    """SIGKILL runs no clean-up: the fork parent dies with the supervisor (its death signal), the
    ranks with the parent, and the next session removes the folder."""
    from pytest_ltconform.world import remove_stale_worlds

    pytester.makepyfile(supervisor=SUPERVISOR, jobs="import os\n\n\ndef pid(ctx):\n    return os.getpid()\n")
    tmp = pytester.mkdir("tmp")
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=os.pathsep.join([str(pytester.path)] + sys.path))
    proc = subprocess.Popen([sys.executable, "supervisor.py", launcher], cwd=pytester.path, env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        assert line[:1] == ["PIDS"], line
        parent, ranks, root = int(line[1]), [int(p) for p in line[2:4]], line[4]
        watched = ranks + ([parent] if launcher == "fork" else [])
        assert all(_alive(pid) for pid in watched) and os.path.isdir(root)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        assert wait_until(lambda: not any(_alive(pid) for pid in watched), 15), \
            [pid for pid in watched if _alive(pid)]
        assert root in remove_stale_worlds(str(tmp)) and os.listdir(tmp) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


PARENT_KILLED = '''
import os
import signal
import sys
import time

from pytest_ltconform.world import JobRequest, LocalWorld


def pid(ctx):
    return os.getpid()


def test_a_world_whose_parent_was_killed_forks_from_a_new_one():
    world = LocalWorld(2, preload=("torch.distributed",))
    try:
        first = world.run(JobRequest("test_parent_killed:pid", timeout_s=120)).values
        os.kill(world.launcher.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while world.alive and time.monotonic() < deadline:  # its ranks die with it (their death signal)
            time.sleep(0.1)
        assert not world.alive
        second = world.run(JobRequest("test_parent_killed:pid", timeout_s=120))
    finally:
        world.close()
    assert second.status == "ok" and set(second.values).isdisjoint(first)
    assert world.launcher.imports == 2 and world.cold_starts == 2


def test_a_world_whose_store_keeper_was_killed_gets_a_new_one():
    world = LocalWorld(2, preload=("torch.distributed",))
    try:
        first = world.run(JobRequest("test_parent_killed:pid", timeout_s=120))
        keeper = world._store.pid
        os.kill(keeper, signal.SIGKILL)
        second = world.run(JobRequest("test_parent_killed:pid", timeout_s=120))
        new_keeper = world._store.pid
    finally:
        world.close()
    assert first.status == second.status == "ok", (first, second)
    assert new_keeper != keeper and world.launcher.imports == 1  # a new keeper, forked from the same parent
    assert "torch" not in sys.modules  # the supervisor never held the store itself
'''


def test_ranks_die_with_their_parent_and_the_next_run_forks_from_a_new_one(pytester):
    """Also: a world whose store keeper died gets a new keeper from the same parent."""
    pytester.makepyfile(test_parent_killed=PARENT_KILLED)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


HEAVY_AT_THE_END = """
import sys


def pytest_unconfigure(config):
    print("HEAVY IN PYTEST:", ", ".join(sorted({"torch", "lightning", "deepspeed"} & set(sys.modules))) or "nothing",
          file=sys.stderr)
"""


@pytest.mark.world
def test_pytest_never_imports_torch_when_ranks_are_forked(pytester, no_leftover_ranks):
    """The store the ranks meet in is served by a process forked from their parent, the target
    is validated in another, DeepSpeed's availability is the parent's import: pytest's own
    process imports none of torch, Lightning and DeepSpeed (about 2 CPU seconds each)."""
    pytester.makeconftest(HEAVY_AT_THE_END)
    result = pytester.runpytest_subprocess("--ltconform", "lightning.pytorch.demos.boring_classes.BoringModel",
                                           "--ltconform-strategies", "ddp,deepspeed", "--ltconform-nodes", "1",
                                           "-k", "sync-dist",
                                           "-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 1 and "failed" not in outcomes, result.stdout.str()[-3000:]
    result.stderr.fnmatch_lines(["HEAVY IN PYTEST: nothing"])


FIXTURE = '''
import os
import sys


def parent(ctx):
    return os.getppid(), "lightning" in sys.modules


def test_parent(ltconform_world):
    parents, lightning = zip(*ltconform_world(2).run(parent))
    if os.environ["EXPECT"] == "spawn":
        assert parents == (os.getpid(),) * 2
    else:
        assert parents[0] == parents[1] != os.getpid()
    assert lightning == (False, False)  # LTCONFORM_PRELOAD replaced the preload
'''


@pytest.mark.parametrize("how", ["fork", "spawn"])
def test_the_launcher_option_reaches_the_fixture_worlds(pytester, monkeypatch, how):
    monkeypatch.setenv("EXPECT", how)
    monkeypatch.setenv("LTCONFORM_PRELOAD", "torch.distributed")  # a world of the fixture, without Lightning
    pytester.makepyfile(test_fixture=FIXTURE)
    args = ["--ltconform-launcher", how] if how == "spawn" else []
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
    result.assert_outcomes(passed=1)


def test_the_fork_parent_imports_once_what_every_rank_of_the_session_imports(monkeypatch):
    """Lightning, the libraries the selected strategies load on every rank, and the plugin's own
    rank-side modules (the harness, each built-in contract's probe): no forked rank imports or
    compiles them again. A project's contracts and the user's code are never among them."""
    import importlib.util

    from pytest_ltconform import contracts
    from pytest_ltconform.controller import preload_for
    from pytest_ltconform.settings import Settings
    from pytest_ltconform.world.protocol import PRELOAD_ENV

    monkeypatch.delenv(PRELOAD_ENV, raising=False)
    every = preload_for(Settings(target="m:Model"))
    assert every[:4] == ("lightning.pytorch", "torch.distributed.checkpoint", "deepspeed", "torch._inductor.compile_fx")
    ours = every[4:]
    assert ours == contracts.rank_modules() and ours[0] == "pytest_ltconform.harness"
    assert {m.split(".")[2] for m in ours[1:]} == {cid.replace("-", "_") for cid in contracts.ids()}
    assert all(importlib.util.find_spec(m) is not None for m in ours)
    ddp = preload_for(Settings(target="m:Model", strategies=("ddp",)))
    assert ddp == ("lightning.pytorch", *ours)
    assert preload_for(Settings(target=None)) == ("lightning.pytorch", *ours)


def test_a_pool_has_one_fork_parent_per_rank_environment_and_none_preloads_deepspeed_for_cuda():
    """Worlds of every size with one rank environment share one parent (one import for the
    session); a CUDA world's parent leaves DeepSpeed out (its import may initialise CUDA)."""
    from pytest_ltconform.vocabulary import preload_modules
    from pytest_ltconform.world import WorldPool

    pool = WorldPool(preload=preload_modules(("deepspeed",)))
    try:
        cpu2, cpu1 = (pool.get(n, "gloo", 30.0, {"DS_ACCELERATOR": "cpu"}) for n in (2, 1))
        gpu = pool.get(2, "nccl", 30.0, {})
        assert cpu2.launcher is cpu1.launcher and cpu2.launcher is not gpu.launcher
        assert cpu2.launcher.preload == ("lightning.pytorch", "deepspeed", "torch._inductor.compile_fx")
        assert gpu.launcher.preload == gpu.preload == ("lightning.pytorch",)
        assert pool.imports == 0  # nothing is started before a run
    finally:
        pool.close()


FRESH = '''
import os
import sys
import time

import pytest

from pytest_ltconform.world import JobRequest, LocalWorld
from pytest_ltconform.world import zygote

IMPORTED_IN = os.getpid()


def ask(ctx, entry, args, timeout_s=60.0):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LTCONFORM_")}
    env.update(ASKED="yes", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    got = zygote.run_fresh(entry, args, env=env, cwd=os.getcwd(), folder=ctx.job_dir, timeout_s=timeout_s)
    return {"rank": os.getpid(), "parent": os.getppid(), "got": got}


def rank0_asks(ctx, entry, args, timeout_s=60.0):
    return ask(ctx, entry, args, timeout_s) if ctx.rank == 0 else None


def test_a_fresh_process_is_a_sibling_that_never_imported_the_ranks_code():
    world = LocalWorld(2, preload=("torch.distributed",))
    try:
        result = world.run(JobRequest("test_fresh:rank0_asks", args=("fresh_entry:facts", ["hello"]), timeout_s=120))
        crashed = world.run(JobRequest("test_fresh:rank0_asks", args=("fresh_entry:crash", []), timeout_s=120))
        parent = world.launcher.pid
    finally:
        world.close()
    asked = result.values[0]
    got = asked["got"]
    assert got["marker"] == "hello" and got["asked_env"] == "yes" and got["pid"] != asked["rank"], asked
    assert got["ppid"] == asked["parent"] == parent and got["sid"] == got["pid"], asked  # forked by the parent
    assert got["rank_module_loaded"] is False and got["torch_preloaded"] is True, asked
    assert crashed.values[0]["got"]["crashed"] == 5 and "about to crash" in crashed.values[0]["got"]["tail"]


def test_a_fresh_process_past_its_time_is_killed(tmp_path):
    world = LocalWorld(2, preload=("torch.distributed",))
    pid_file = str(tmp_path / "pid")
    try:
        result = world.run(JobRequest("test_fresh:rank0_asks", args=("fresh_entry:sleep", [pid_file]),
                                      kwargs={"timeout_s": 2.0}, timeout_s=120))
    finally:
        world.close()
    assert result.values[0]["got"] == {"timeout": 2.0}
    assert wait_gone(int(open(pid_file).read()))


def test_a_fresh_process_goes_with_the_rank_that_asked_for_it(tmp_path):
    world = LocalWorld(2, preload=("torch.distributed",))
    pid_file = str(tmp_path / "pid")
    try:
        result = world.run(JobRequest("test_fresh:rank0_asks", args=("fresh_entry:sleep", [pid_file]),
                                      kwargs={"timeout_s": 600.0}, timeout_s=5))
        pid = int(open(pid_file).read())
        assert result.status != "ok"  # the run was stopped at its time limit: its ranks were killed
        assert wait_gone(pid)
    finally:
        world.close()


def test_a_spawned_rank_has_no_parent_to_ask():
    world = LocalWorld(2, preload=(), launcher="spawn")
    try:
        result = world.run(JobRequest("test_fresh:rank0_asks", args=("fresh_entry:facts", ["x"]), timeout_s=120))
    finally:
        world.close()
    assert result.values[0]["got"] is None


def wait_gone(pid, seconds=30.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                if fh.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    return True
        except OSError:
            return True
        time.sleep(0.1)
    return False
'''

FRESH_ENTRY = '''
import os
import sys
import time


def facts(marker):
    return {"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "marker": marker,
            "asked_env": os.environ.get("ASKED"), "cwd": os.getcwd(),
            "rank_module_loaded": "test_fresh" in sys.modules, "torch_preloaded": "torch.distributed" in sys.modules}


def crash():
    print("about to crash", flush=True)
    os._exit(5)


def sleep(pid_file):
    with open(pid_file, "w") as fh:
        fh.write(str(os.getpid()))
    time.sleep(600)
'''


def test_a_rank_asks_its_parent_for_a_fresh_process(pytester):
    """A forked rank gets a fresh process (spawn-safety's import check) from the parent that forked
    it: a fork, not an interpreter, without the rank's own imports; one that crashes says so, one
    past its time or whose rank was killed is killed; a spawned rank is told to start one itself."""
    pytester.makepyfile(test_fresh=FRESH, fresh_entry=FRESH_ENTRY)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)


SHARED_PARENT = '''
import os
import sys

from pytest_ltconform.world import JobRequest, WorldPool, session_folder
from pytest_ltconform.world.share import SessionShare


def facts(ctx):
    return {"pid": os.getpid(), "ppid": os.getppid(), "path0": sys.path[0]}


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_workers_of_a_session_fork_their_ranks_from_one_parent():
    path = session_folder()
    # Two pools on one session folder: what two pytest-xdist workers of one session hold.
    first = WorldPool(preload=("torch.distributed",), share=SessionShare(path, os.getpid()), slots=1)
    second = WorldPool(preload=("torch.distributed",), share=SessionShare(path, os.getpid()), slots=1)
    try:
        a = first.get(2).run(JobRequest("test_shared_parent:facts", timeout_s=120))
        b = second.get(2).run(JobRequest("test_shared_parent:facts", timeout_s=120))
        parent = first.get(2).launcher.pid
        roots = (first.get(2).root, second.get(2).root)
        imports = (first.imports, second.imports)
        second.close()  # one worker ends: the parent and the other worker's ranks stay
        c = first.get(2).run(JobRequest("test_shared_parent:facts", timeout_s=120))
    finally:
        second.close()
        first.close()
    assert (a.status, b.status, c.status) == ("ok", "ok", "ok"), (a, b, c)
    assert {v["ppid"] for v in a.values + b.values + c.values} == {parent}
    assert imports == (1, 0)  # one import serves both workers' ranks
    assert [v["pid"] for v in c.values] == [v["pid"] for v in a.values]
    # Each rank runs in the world folder of the worker that asked for it, not the parent's.
    assert [v["path0"] for v in a.values] == [roots[0]] * 2 and [v["path0"] for v in b.values] == [roots[1]] * 2
    assert not _alive(parent)  # gone with the last worker
'''


def test_the_workers_of_a_session_share_one_fork_parent(pytester):
    """Under pytest-xdist every worker's ranks are forked from one parent per preload list (one
    import for the session); a worker that ends takes its own ranks down, not the parent or
    another worker's ranks, and the parent stops with the last worker."""
    pytester.makepyfile(test_shared_parent=SHARED_PARENT)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=1)
