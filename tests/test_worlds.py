"""End-to-end runs in real worlds of 2 gloo ranks, each in a pytest subprocess.

Each test here starts its own pytest process, so a hung or killed world can never take this
session down; the number of runs is kept small because a cold world costs about 5 s.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
from conftest import BORING, CONFORMANCE, case, wait_until

pytest_plugins = ["pytester"]


def _mpi4py_that_aborts(pytester, monkeypatch) -> None:
    # A host with mpi4py installed but no working Open MPI (a GPU box's image, a login node): importing
    # mpi4py.MPI aborts the process. Lightning probes MPI only when no launcher is recognised, so ranks
    # started like torchrun must be recognised as torchrun's.
    fake = pytester.path / "site"
    (fake / "mpi4py").mkdir(parents=True)
    (fake / "mpi4py" / "__init__.py").write_text("")
    (fake / "mpi4py" / "MPI.py").write_text("import os\nos._exit(41)  # what a failing MPI_Init does\n")
    (fake / "mpi4py-4.0.0.dist-info").mkdir()
    (fake / "mpi4py-4.0.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: mpi4py\nVersion: 4.0.0\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(fake), os.environ.get("PYTHONPATH")])))


def test_boring_model_passes_with_json_report_and_ranks_never_probe_mpi(pytester, monkeypatch, no_leftover_ranks):
    """Two independent facts of one session on BoringModel (one session, not two): the report's
    shape, and ranks that never import an MPI that would abort them."""
    _mpi4py_that_aborts(pytester, monkeypatch)
    report = pytester.path / "out" / "ltconform.json"
    result = pytester.runpytest_subprocess("--ltconform", BORING, "--ltconform-strategies", "ddp",
                                           "--ltconform-report", str(report), "-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 2 and not outcomes.get("failed") and not outcomes.get("errors"), outcomes
    result.stdout.fnmatch_lines(["*ltconform summary*", "*all-rank-save*passed*", "*sync-dist*passed*"])
    doc = json.loads(report.read_text())
    assert list(doc) == ["target", "world_size", "versions", "results", "targets", "cold_starts", "not_run",
                         "interrupted", "exitstatus", "runs", "imports", "seeding"]
    assert doc["seeding"] == {"mode": "both", "seed": 0, "ranks": [0, 1]}
    assert doc["target"] == BORING and doc["world_size"] == 2
    assert [(t["id"], t["model"], t["results"]) for t in doc["targets"]] == [(BORING, BORING, doc["results"])]
    assert {"python", "torch", "lightning"} <= set(doc["versions"])
    judged = doc["results"]  # tiers not run here are counted in not_run, not listed here
    # the fit[ddp] run item's record included; memory[ddp] is an advisory table (no device size stated)
    assert len(judged) == outcomes["passed"] + outcomes.get("advisory", 0)
    for rec in doc["results"]:
        assert {"contract", "strategy", "world_size", "outcome", "message", "evidence", "duration_s"} <= set(rec)
        assert rec["target"] == BORING
    assert {r["outcome"] for r in judged if r["contract"] != "memory"} == {"passed"}
    assert [r["outcome"] for r in judged if r["contract"] == "memory"] == ["advisory"]
    # The ddp items of tiers this machine cannot run are not collected; the report counts them per tier.
    hidden = {entry["tier"]: entry for entry in doc["not_run"]}
    assert hidden["multinode"]["reason"].startswith("not inside a multi-node world")
    if "gpu" in hidden:
        assert hidden["gpu"]["reason"].startswith("needs 2 CUDA devices, found")
    assert (doc["interrupted"], doc["exitstatus"]) == (False, 0)


PL_MODULE = '''
import torch
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))

class Model(pl.LightningModule):
    """A module of the standalone pytorch_lightning package (as neuralforecast/darts use)."""
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True, batch_size=len(y))
    def on_train_epoch_end(self):
        if self.global_rank == 0:
            self.trainer.save_checkpoint("rank0-only.ckpt")
    def train_dataloader(self):
        return DataLoader(_data(32, 1), batch_size=4)
    def val_dataloader(self):
        return DataLoader(_data(16, 2), batch_size=4)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

def trainer_kwargs():
    return {"callbacks": [ModelCheckpoint(monitor="val_loss")], "enable_checkpointing": True}
'''


def test_pytorch_lightning_namespace_is_first_class(pytester, no_leftover_ranks):
    """A pytorch_lightning module runs on a pytorch_lightning Trainer, with its callbacks, and
    the trace patches that namespace: the rank-guarded save is caught with its call site, and
    the hung world is reported."""
    pytester.makepyfile(pl_model=PL_MODULE)
    result = pytester.runpytest_subprocess(
        "--ltconform", "pl_model.Model", "--ltconform-trainer", "pl_model:trainer_kwargs",
        "--ltconform-strategies", "ddp", "--ltconform-timeout", "30", "-p", "no:cacheprovider",
        "--ltconform-nodes", "1",
        "-k", "all-rank-save[ or sync-dist[")  # the two the checks below name; the other runs add only time
    result.stdout.fnmatch_lines([
        "*[[]all-rank-save[]] FAILED*Trainer.save_checkpoint called on rank 0 only*under an "
        "`if self.global_rank == 0:` guard, at pl_model.py:24 (Model.on_train_epoch_end)*",
    ])
    result.stdout.fnmatch_lines(["*Where each rank was:*", "*rank 0 (*", "*rank 1 (*"])
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed") == 1 and outcomes.get("passed", 0) >= 1, outcomes


LEAKY = '''
import os, random, sys
import helper_state

def leak(ctx):
    import torch
    os.environ["LTC_LEAK"] = "leaked"
    helper_state.COUNTER += 1
    torch.manual_seed(1234)
    random.seed(99)
    sys.path.append("/nonexistent/leak")
    os.chdir("/")
    return os.getpid()

def observe(ctx):
    import torch
    from pytest_ltconform.world.rank import current_context
    return {"pid": os.getpid(), "env": os.environ.get("LTC_LEAK"), "counter": helper_state.COUNTER,
            "rand": float(torch.rand(1)), "py": random.random(), "path": "/nonexistent/leak" in sys.path,
            "cwd_is_run_dir": os.getcwd() == ctx.run_dir, "current": current_context() is ctx}

def sum_ranks(ctx, offset):
    import torch, torch.distributed as dist
    t = torch.tensor([ctx.rank + offset])
    dist.all_reduce(t)
    return int(t)

def fail_on_rank_one(ctx):
    if ctx.rank == 1:
        raise ValueError("bad shard on rank 1")
    return "ok"

def where_it_works(ctx):
    return ctx.trace_path, ctx.job_dir, ctx.run_dir

def test_jobs_share_ranks_but_not_state(ltconform_world):
    world = ltconform_world(world_size=2)
    clean = world.run(observe)
    pids = world.run(leak)
    after = world.run(observe)
    assert [o["pid"] for o in after] == pids == [o["pid"] for o in clean]   # same processes: no cold start
    assert after == clean, (clean, after)                                   # and nothing leaked
    assert all(o["current"] for o in clean)  # the job functions see the runner's context
    assert all(o["cwd_is_run_dir"] for o in clean)  # the ranks share the job's folder, as on one node
    assert world.run(sum_ranks, 10) == [21, 21]
    # The rank records where the supervisor reads: both spell the files through world.protocol.
    from pytest_ltconform.world import protocol
    for rank, (trace, job_dir, run_dir) in enumerate(world.run(where_it_works)):
        assert trace == protocol.trace_file(run_dir, rank) and job_dir == protocol.rank_dir(run_dir, rank)

def test_failed_rank_is_reported_with_its_traceback(ltconform_world):
    ltconform_world(world_size=2).run(fail_on_rank_one)

def stuck_in_user_code(ctx):
    import time
    import torch.distributed as dist
    if ctx.rank == 1:
        time.sleep(600)  # a rank that never reaches the collective
    dist.barrier()

def test_hung_rank_is_killed_and_diagnosed(ltconform_world):
    ltconform_world(world_size=2, timeout_s=8).run(stuck_in_user_code)

def exit_on_rank_one(ctx):
    import torch.distributed as dist
    if ctx.rank == 1:
        os._exit(7)  # a rank that dies without a traceback
    dist.barrier()

def test_dead_rank_is_reported(ltconform_world):
    ltconform_world(world_size=2, timeout_s=30).run(exit_on_rank_one)
'''


def test_ltconform_world_fixture_reuses_ranks_and_isolates_jobs(pytester, monkeypatch, no_leftover_ranks):
    monkeypatch.setenv("LTCONFORM_PRELOAD", "torch")  # machinery: its ranks need no Lightning
    pytester.makepyfile(helper_state="COUNTER = 0\n", test_user_dist=LEAKY)
    sleep_line = next(n for n, line in enumerate(LEAKY.lstrip("\n").splitlines(), 1) if "time.sleep(600)" in line)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v")
    result.assert_outcomes(passed=1, failed=3)
    result.stdout.fnmatch_lines([
        "*ltconform_world.run(test_user_dist:fail_on_rank_one) failed on rank(s) 1 of a 2-rank world:",
        "*rank 1: error (ValueError: bad shard on rank 1)*",
        "[[]rank1[]] ValueError: bad shard on rank 1",
    ])
    # The hung rank: killed, with its faulthandler stack pointing at the user's line.
    result.stdout.fnmatch_lines([
        "*ltconform_world.run(test_user_dist:stuck_in_user_code) failed on rank(s) * of a 2-rank world:",
        "*rank(s) 1 were still running after * s and were killed (SIGKILL)*",
        f"*rank 1 (hung): stack: stuck_in_user_code() in test_user_dist.py:{sleep_line}*",
    ])
    # A rank that dies: named with its exit code, the other rank's error alongside.
    result.stdout.fnmatch_lines([
        "*ltconform_world.run(test_user_dist:exit_on_rank_one) failed on rank(s) * of a 2-rank world:",
        "*--- rank 1: died (exit code 7)*",
    ])
    result.stdout.fnmatch_lines(["*Rank 1 exited without a result (exit code 7).*"])


# Each rank's DataLoader has 2 workers, which block in the dataset after their first batch: a worker busy
# in user code never checks for its parent, so only the plugin can take it down.
WORKERS = '''
import time

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info


class Slow(Dataset):
    fetched = 0  # per process: each worker has its own copy

    def __len__(self):
        return 64

    def __getitem__(self, i):
        self.fetched += 1
        if get_worker_info() is not None and self.fetched > 4:  # a worker's first batch (4 items) only
            time.sleep(900)
        x = torch.full((4,), float(i))
        return x, x[:1]


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        return DataLoader(Slow(), batch_size=4, num_workers=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
'''


def _tagged(tag: str, but: int) -> list[int]:
    """Live processes (not zombies) whose environment carries LTCONFORM_TEST_TAG=tag, except ``but``."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                tagged = f"LTCONFORM_TEST_TAG={tag}".encode() in fh.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as fh:
                zombie = fh.read().rsplit(b")", 1)[1].split()[0] == b"Z"
        except OSError:
            continue
        if tagged and not zombie and int(entry) != but:
            found.append(int(entry))
    return found


def _pymp_folders(base) -> list[str]:
    return [str(p) for p in base.rglob("pymp-*")]


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_interrupted_or_crashed_pytest_leaves_no_rank_behind(pytester, how, monkeypatch):
    """Ctrl-C, a polite kill and a crash of the pytest process mid-run all take the ranks down, with
    their DataLoader workers and the workers' pymp-* folders."""
    from pytest_ltconform.world import remove_stale_worlds

    pytester.makepyfile(workers=WORKERS)
    tmp = pytester.mkdir("tmp")
    tag = f"{how}-{os.getpid()}-{time.monotonic_ns()}"
    monkeypatch.setenv("TMPDIR", str(tmp))  # the session's, its ranks' and their workers'
    monkeypatch.setenv("LTCONFORM_TEST_TAG", tag)
    devnull = open(os.devnull, "w")
    # A child inherits an ignored SIGINT (a suite started with `&` by a non-interactive shell), and
    # Python then keeps ignoring it: give the pytest under test the default disposition a terminal has.
    proc = pytester.popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--ltconform",
                           f"{pytester.path / 'workers.py'}:Model", "--ltconform-timeout", "300",
                           "--ltconform-strategies", "ddp", "-k", "all-rank-save"],
                          stdout=devnull, stderr=devnull,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # 2 ranks and their 4 workers.
        assert wait_until(lambda: len(_tagged(tag, but=proc.pid)) >= 6, 240), f"workers never started ({how})"
        # A worker makes its pymp-* folder when it sends its first batch; the next one blocks.
        assert wait_until(lambda: len(_pymp_folders(tmp)) >= 2, 120), f"no batch was sent ({how})"
        time.sleep(1.0)
        os.kill(proc.pid, getattr(signal, how))
        proc.wait(timeout=60)
        assert wait_until(lambda: not _tagged(tag, but=proc.pid), 15), \
            f"processes left after {how}: {_tagged(tag, but=proc.pid)}"
        # A killed pytest leaves its world folder (with the pymp-* folders in it) to the next session.
        if how == "SIGKILL":
            remove_stale_worlds(str(tmp))
        assert _pymp_folders(tmp) == [], f"left after {how}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _tagged(tag, but=proc.pid):
            os.kill(pid, signal.SIGKILL)
        devnull.close()


def test_xdist_gives_the_same_verdicts(pytester, no_leftover_ranks):
    path = CONFORMANCE / "all-rank-save/callback_save_rank_zero_only.py"
    args = ["--ltconform", case("all-rank-save/callback_save_rank_zero_only.py"),
            "--ltconform-trainer", f"{path}:trainer_kwargs", "--ltconform-strategies", "ddp",
            "--ltconform-timeout", "30", "--ltconform-nodes", "1", "-p", "no:cacheprovider", "-rA",
            "-k", "all-rank-save[ or sync-dist["]
    result = pytester.runpytest_subprocess("-n", "2", *args)
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed") == 1 and outcomes.get("passed", 0) >= 1, result.stdout.str()[-3000:]
    target = case("all-rank-save/callback_save_rank_zero_only.py")
    result.stdout.fnmatch_lines([f"*FAILED ltconform::{target}::all-rank-save[[]ddp[]]*"])
    result.stdout.fnmatch_lines([f"*PASSED ltconform::{target}::sync-dist[[]ddp[]]*"])
    result.stdout.fnmatch_lines(["*ltconform summary*", "*all-rank-save*failed*"])
