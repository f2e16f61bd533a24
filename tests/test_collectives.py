"""Every collective, not a list of known ones, and the raising rank leads: torch's Flight Recorder
entries of each rank, matched across ranks, name the first collective the ranks issued from
different places; a rank that raised in user code is the cause.
"""

from __future__ import annotations

import importlib.util
import os
import textwrap

import pytest
from conftest import CONFORMANCE

from pytest_ltconform import contracts
from pytest_ltconform.policies import judge
from pytest_ltconform.world import JobResult, RankOutcome
from pytest_ltconform.world.causes import raised_in_user_code
from pytest_ltconform.world.diagnose import call_of

pytest_plugins = ["pytester"]


def _installed(package: str, rest: str) -> str:
    """A file of an installed library, where it really is (so that it is library code)."""
    return os.path.join(importlib.util.find_spec(package).submodule_search_locations[0], rest)


TORCH = _installed("torch", "distributed/fsdp/fully_sharded_data_parallel.py")
LIGHTNING = _installed("lightning", "pytorch/trainer/trainer.py")


def _entry(seq, op, frames=None, sizes=((4,),)):
    return {"pg": "0", "seq": seq, "p2p": 0, "is_p2p": False, "op": op, "sizes": [list(s) for s in sizes],
            "frames": frames or []}


def _dump(entries, frames=True, why="raised"):
    return {"ev": "collectives", "why": why, "frames": frames, "entries": entries, "seq": 99}


def _user_module(tmp_path):
    path = tmp_path / "gradnorms.py"
    path.write_text(textwrap.dedent("""\
        def on_before_optimizer_step(self, optimizer):
            if self.global_rank == 0:
                with summon_full_params(self.trainer.model):
                    pass

        def training_step(self, batch):
            return self.body(batch)
        """))
    return str(path)


def _summon_world(tmp_path, stuck_rank_stack=None):
    """Rank 0 all-gathers inside summon_full_params under a rank guard; rank 1's next forward
    all-gathers the same sizes (they pair up silently), then the ranks' ops differ."""
    user = _user_module(tmp_path)
    common = [_entry(1, "broadcast", [[user, 7, "training_step"]])]
    summon = [[TORCH, 932, "summon_full_params"], [user, 3, "on_before_optimizer_step"]]
    forward = [[TORCH, 850, "forward"], [user, 7, "training_step"]]
    r0 = common + [_entry(2, "all_gather", summon), _entry(3, "all_gather", summon)]
    r1 = common + [_entry(2, "all_gather", forward), _entry(3, "reduce_scatter", forward)]
    ranks = [RankOutcome(0, "error", exc_type="RuntimeError", message="Timed out waiting 30000ms for send",
                         trace=[_dump(r0)]),
             RankOutcome(1, "error", exc_type="RuntimeError", message="Application timeout caused pair closure",
                         trace=[_dump(r1)])]
    return JobResult.of(ranks, 1.0), user


def test_first_mismatch_is_the_first_call_from_different_user_code(tmp_path):
    job, user = _summon_world(tmp_path)
    mm = job.mismatch
    assert (mm["seq"], mm["broke_at"]) == (2, 3)  # seq 2 paired silently; seq 3 broke the world
    assert mm["calls"][0]["site"] == {"file": user, "line": 3, "func": "on_before_optimizer_step"}
    assert mm["calls"][0]["via"]["func"] == "summon_full_params"
    assert mm["calls"][1]["site"]["line"] == 7 and mm["calls"][1]["op"] == "all_gather"


def test_same_collectives_on_every_rank_are_no_mismatch(tmp_path):
    user = _user_module(tmp_path)
    entries = [_entry(1, "all_reduce", [[user, 7, "training_step"]]), _entry(2, "barrier", [[user, 7, "x"]])]
    ranks = [RankOutcome(r, "error", exc_type="ValueError", message="x", trace=[_dump(entries)]) for r in (0, 1)]
    assert JobResult.of(ranks, 1.0).mismatch is None


def test_a_stuck_rank_without_frames_gets_its_stack_for_the_collective_it_waits_in(tmp_path):
    user = _user_module(tmp_path)
    stack = ("Current thread 0x00007f (most recent call first):\n"
             f'  File "{LIGHTNING}", line 1714 in callback_metrics\n'
             f'  File "{user}", line 3 in on_before_optimizer_step\n')
    r0 = [_entry(1, "barrier"), _entry(2, "all_reduce")]
    r1 = [_entry(1, "barrier"), _entry(2, "barrier")]
    ranks = [RankOutcome(0, "hung", stack=stack, trace=[_dump(r0, frames=False, why="stuck")]),
             RankOutcome(1, "hung", trace=[_dump(r1, frames=False, why="stuck")])]
    mm = JobResult.of(ranks, 1.0).mismatch
    assert mm["seq"] == 2 and mm["calls"][0]["via"]["func"] == "callback_metrics"
    assert mm["calls"][0]["site"]["line"] == 3 and mm["calls"][1]["site"] is None


def test_a_metrics_read_names_the_values_it_syncs(tmp_path, fake_runs):
    user = tmp_path / "history.py"
    user.write_text("def on_validation_epoch_end(self, trainer, pl_module):\n"
                    "    if trainer.is_global_zero:\n"
                    "        metrics = trainer.callback_metrics\n")
    log = {"ev": "log", "name": "val_loss", "sync_dist": True, "rank_zero_only": False, "seq": 1}
    metrics = [[LIGHTNING, 1714, "callback_metrics"], [str(user), 3, "on_validation_epoch_end"]]
    barrier = [[LIGHTNING, 300, "barrier"], [str(user), 9, "on_validation_epoch_end"]]
    ranks = [RankOutcome(r, "error", exc_type="RuntimeError", message="Timed out waiting 30000ms",
                         trace=[log, _dump([_entry(1, "barrier", frames), _entry(2, op, frames)])])
             for r, frames, op in ((0, metrics, "all_reduce"), (1, barrier, "barrier"))]
    run = fake_runs.of(ranks, status="error")
    run.job = JobResult.of(ranks, 1.0)
    verdict = judge(contracts.get_contract("all-rank-save"), run)
    assert verdict.summary.startswith("callback_metrics (trainer.py:1714; its barrier was this collective) called "
                                      "on rank 0 under an `if trainer.is_global_zero:` guard")
    assert any(e.rank == 0 and e.detail.endswith("sync_dist=True is a collective: 'val_loss'")
               for e in verdict.evidence)


def test_call_of_names_the_library_function_the_user_called():
    frames = [[_installed("lightning", "fabric/utilities/distributed.py"), 214, "_sync_ddp"],
              [LIGHTNING, 1714, "callback_metrics"], ["/home/me/cb.py", 27, "on_validation_epoch_end"],
              [LIGHTNING, 99, "_call_callback_hooks"]]
    call = call_of(frames)
    assert call["site"] == {"file": "/home/me/cb.py", "line": 27, "func": "on_validation_epoch_end"}
    assert call["via"] == {"file": LIGHTNING, "line": 1714, "func": "callback_metrics"}


def test_all_rank_save_fails_on_the_guarded_collective_with_both_ranks(tmp_path, fake_runs):
    job, user = _summon_world(tmp_path)
    run = fake_runs.of(job.ranks, status="error")
    run.job = job
    assert contracts.blamed(run) == "all-rank-save"
    verdict = judge(contracts.get_contract("all-rank-save"), run)
    assert verdict.outcome == "failed" and verdict.category == "deadlock"
    assert verdict.summary.startswith("summon_full_params (fully_sharded_data_parallel.py:932; its all_gather was "
                                      "this collective) called on rank 0 under an `if self.global_rank == 0:` guard")
    assert "gradnorms.py:3 (on_before_optimizer_step)" in verdict.summary
    ranks = {e.rank: e for e in verdict.evidence if e.rank is not None}
    assert set(ranks) == {0, 1}
    assert ranks[1].site.endswith("gradnorms.py:7 (training_step)") and "forward" in ranks[1].detail
    assert verdict.fix.startswith("call summon_full_params() on every rank")
    # The other contracts name it instead of a failure or "the run stopped in your code" of their own.
    other = judge(contracts.get_contract("sync-dist"), run)
    assert other.outcome in ("passed", "not_judged") and "all-rank-save[ddp]" in other.render()


# -- a rank that raised in user code leads ---------------------------------------------------------

def _validation_raised(tmp_path, fake_runs):
    user = tmp_path / "model.py"
    user.write_text("def validation_step(self, batch, batch_idx):\n"
                    "    if self.global_rank == 1:\n"
                    "        raise ValueError('corrupt sample 3')\n"
                    "    self.log('val_loss', 1.0, sync_dist=True)\n")
    traceback = ("Traceback (most recent call last):\n"
                 f'  File "{_installed("lightning", "pytorch/loops/evaluation_loop.py")}", line 10, in run\n    x()\n'
                 f'  File "{user}", line 3, in validation_step\n    raise ValueError("corrupt sample 3")\n'
                 "ValueError: corrupt sample 3\n")
    site = {"file": str(user), "line": 4, "func": "validation_step"}
    hook = {"ev": "hook", "i": 5, "name": "[LightningModule]Model.validation_step", "h": 5, "epoch": 0, "step": 0}
    log = {"ev": "log", "name": "val_loss", "hook": "validation_step", "site": site, "user": True,
           "sync_dist": True, "rank_zero_only": False, "h": 5, "seq": 7}
    peer = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:7361"
    # Rank 0 logged and went on to its next batch; rank 1 raised before its log and unwound.
    r0 = [hook, log, {"ev": "hook_exit", "i": 5, "h": 5},
          {"ev": "hook", "i": 6, "name": "[LightningModule]Model.validation_step", "h": 6, "epoch": 0, "step": 0}]
    r1 = [hook, {"ev": "hook_exit", "i": 5, "h": 5},
          {"ev": "hook", "i": 6, "name": "[LightningModule]Model.on_exception", "h": 6, "epoch": 0, "step": 0}]
    ranks = [fake_runs.rank(0, trace=r0, status="error", exc_type="RuntimeError", message=peer),
             fake_runs.rank(1, trace=r1, status="error", exc_type="ValueError", message="corrupt sample 3",
                            traceback=traceback)]
    run = fake_runs.of(ranks, status="error")
    run.job = JobResult.of(ranks, 1.0)
    return run


def test_a_rank_that_raised_in_user_code_leads_not_the_log_its_peer_made(tmp_path, fake_runs):
    run = _validation_raised(tmp_path, fake_runs)
    assert raised_in_user_code(run.job.ranks[1]) and not raised_in_user_code(run.job.ranks[0])
    assert contracts.blamed(run) is None  # no contract owns the user's own exception
    first = judge(contracts.get_contract("sync-dist"), run)
    assert first.outcome == "error" and first.category == "crash"
    assert first.summary.startswith("the run did not finish: rank 1 raised ValueError at ")
    assert "model.py:3 (validation_step): corrupt sample 3" in first.summary
    assert first.diagnosis.count("ValueError: corrupt sample 3") == 1  # its traceback, once
    assert "Consequences, not causes: rank 0 then failed in a collective" in first.diagnosis
    assert "self.log" not in first.render() and "First divergence" not in first.render()
    later = judge(contracts.get_contract("all-rank-save"), run)
    assert later.outcome == "not_judged" and "rank 1 raised ValueError" in later.summary


def test_a_library_check_that_raised_is_not_user_code():
    tb = ("Traceback (most recent call last):\n"
          '  File "/home/me/model.py", line 3, in on_train_end\n    trainer.save_checkpoint(p)\n'
          f'  File "{LIGHTNING}", line 9, in save_checkpoint\n    x\n'
          "MisconfigurationException: no\n")
    assert not raised_in_user_code(RankOutcome(0, "error", exc_type="MisconfigurationException", traceback=tb))
    collective = tb.replace(LIGHTNING, _installed("torch", "distributed/distributed_c10d.py"))
    assert not raised_in_user_code(RankOutcome(0, "error", exc_type="RuntimeError", traceback=collective))


# -- real worlds ----------------------------------------------------------------------------------

CALLBACK_METRICS = CONFORMANCE / "all-rank-save" / "callback_metrics_read_under_rank_guard.py"
HELPER = CONFORMANCE / "all-rank-save" / "autograd_all_reduce_helper_rank_zero.py"


def _run_case(pytester, path, *extra):
    pytester.makepyfile(case_under_test=path.read_text())
    pytester.syspathinsert()
    target = "case_under_test.py"
    return pytester.runpytest_subprocess(
        "--ltconform", f"{target}:Model", "--ltconform-trainer", f"{target}:trainer_kwargs",
        "--ltconform-strategies", "ddp", "-m", "ltconform_cpu", "-p", "no:cacheprovider", "-rA", *extra)


@pytest.mark.slow
def test_callback_metrics_read_on_rank_zero_fails_all_rank_save_at_the_users_line(pytester, no_leftover_ranks):
    result = _run_case(pytester, CALLBACK_METRICS, "--ltconform-datamodule", "case_under_test.py:DataModule",
                       "-k", "all-rank-save or sync-dist or unused-parameters")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed") == 1 and not outcomes.get("errors"), outcomes
    text = result.stdout.str()
    # The sync behind trainer.callback_metrics, on rank 0 only, at the user's line; rank 1's barrier.
    result.stdout.fnmatch_lines([
        "*all-rank-save*FAILED (deadlocks the world): callback_metrics (trainer.py:*; its barrier was this "
        "collective) called on rank 0 under an `if trainer.is_global_zero:` guard, at "
        "case_under_test.py:27 (on_validation_epoch_end)*",
        "*rank 1 at case_under_test.py:45 (on_validation_epoch_end): collective #*: barrier (*",
    ])
    assert "sync_dist=True is a collective: 'val_loss'" in text
    assert "the run stopped in your code" not in text
    assert "sync-dist[ddp] FAILED" not in text and "unused-parameters[ddp] FAILED" not in text


@pytest.mark.slow
def test_a_collective_a_torch_helper_makes_on_rank_zero_is_found_without_a_tap(pytester, no_leftover_ranks):
    result = _run_case(pytester, HELPER, "-k", "all-rank-save")
    assert result.parseoutcomes().get("failed") == 1, result.parseoutcomes()
    result.stdout.fnmatch_lines([
        "*all-rank-save*FAILED (deadlocks the world): all_reduce (functional.py:*; its all_reduce was this "
        "collective) called on rank 0 under an `if self.global_rank == 0:` guard, at "
        "case_under_test.py:40 (on_train_epoch_end)*",
    ])


FLIGHT = '''
import pytest

from pytest_ltconform.world import JobRequest, LocalWorld


def mismatch(ctx):
    """Rank 0 broadcasts where rank 1 waits at a barrier, with the recorder of a traced run."""
    import torch
    import torch.distributed as dist

    from pytest_ltconform.trace import Recorder
    from pytest_ltconform.world.rank import stack_path

    recorder = Recorder(ctx.trace_path, ctx.rank)
    recorder.watch_collectives(stack_path())
    try:
        t = torch.ones(2)
        dist.all_reduce(t)
        if ctx.rank == 0:
            dist.broadcast(t, 0)
        else:
            dist.barrier()
    finally:
        recorder.uninstall()


@pytest.mark.parametrize("pg_timeout_s, job_timeout_s", [(3, 300), (600, 20)], ids=["timed-out", "stuck"])
def test_both_ranks_record_the_mismatch(pg_timeout_s, job_timeout_s):
    world = LocalWorld(2, pg_timeout_s=pg_timeout_s, preload=("torch",))
    try:
        result = world.run(JobRequest("test_flight:mismatch", timeout_s=job_timeout_s))
    finally:
        world.close()
    dumps = [[e for e in r.trace if e.get("ev") == "collectives"] for r in result.ranks]
    if pg_timeout_s < job_timeout_s:  # the collective timed out: the rank raised and dumped with frames
        assert [r.status for r in result.ranks] == ["error", "error"]
        assert [(ds[-1]["why"], ds[-1]["frames"]) for ds in dumps] == [("raised", True)] * 2
    else:  # blocked until killed: its thread dumped without frames; the stack gives them
        assert [r.status for r in result.ranks] == ["hung", "hung"]
        assert all(ds and {d["why"] for d in ds} <= {"blocked", "stuck"} for ds in dumps), dumps
    mm = result.mismatch
    assert mm is not None and mm["seq"] == 2, mm
    assert (mm["calls"][0]["op"], mm["calls"][1]["op"]) == ("broadcast", "barrier")
    lines = [line.strip() for line in open(__file__).read().splitlines()]
    expected = (lines.index("dist.broadcast(t, 0)") + 1, lines.index("dist.barrier()") + 1)
    assert (mm["calls"][0]["site"]["line"], mm["calls"][1]["site"]["line"]) == expected
'''


@pytest.mark.slow
def test_flight_recorder_dump_from_a_timed_out_and_from_a_stuck_rank(pytester, no_leftover_ranks):
    pytester.makepyfile(test_flight=FLIGHT)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=2)


def test_rank_branches_that_make_the_same_collective_are_not_the_first_mismatch(tmp_path):
    # Each rank broadcasts from its own branch (paired as meant); the break comes later.
    user = _user_module(tmp_path)
    r0 = [_entry(1, "broadcast", [[user, 3, "setup"]]), _entry(2, "all_reduce", [[user, 7, "step"]])]
    r1 = [_entry(1, "broadcast", [[user, 4, "setup"]]), _entry(2, "barrier", [[user, 7, "step"]])]
    ranks = [RankOutcome(r, "error", exc_type="RuntimeError", message="Timed out waiting", trace=[_dump(t)])
             for r, t in enumerate((r0, r1))]
    mm = JobResult.of(ranks, 1.0).mismatch
    assert (mm["seq"], mm["broke_at"]) == (2, 2)


def test_only_an_exception_out_of_torch_distributed_pays_for_a_dump_with_frames():
    from pytest_ltconform.trace import _collective_raised

    namespace: dict = {}
    exec(compile("def wait():\n    raise RuntimeError('Timed out waiting 30000ms for recv')\n",
                 os.path.join("site-packages", "torch", "distributed", "distributed_c10d.py"), "exec"), namespace)
    try:
        namespace["wait"]()
    except RuntimeError as exc:
        timed_out = exc
    try:
        raise ValueError("corrupt sample 3")
    except ValueError as exc:
        user = exc
    assert _collective_raised(timed_out) and not _collective_raised(user) and not _collective_raised(None)


RAISES_IN_VALIDATION = """
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x[:, :2].sum(1, keepdim=True))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(6, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        if self.global_rank == 1 and batch_idx == 1:
            raise ValueError("corrupt validation sample on rank 1")
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def train_dataloader(self):
        return DataLoader(_rows(32, 1), batch_size=4)

    def val_dataloader(self):
        return DataLoader(_rows(16, 2), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
"""


@pytest.mark.slow
def test_a_validation_step_that_raised_on_one_rank_leads_with_its_line(pytester, no_leftover_ranks):
    pytester.makepyfile(val_raise=RAISES_IN_VALIDATION)
    pytester.syspathinsert()
    result = pytester.runpytest_subprocess("--ltconform", "val_raise.py:Model", "--ltconform-strategies", "ddp",
                                           "-m", "ltconform_cpu", "-p", "no:cacheprovider",
                                           "-k", "all-rank-save or sync-dist or data-sharding")
    outcomes = result.parseoutcomes()
    assert outcomes.get("errors") == 1 and not outcomes.get("failed"), outcomes  # no sync-dist "deadlock"
    result.stdout.fnmatch_lines([
        "*NOT JUDGED (the run stopped in your code): the run did not finish: rank 1 raised ValueError at "
        "val_raise.py:24 (validation_step): corrupt validation sample on rank 1.",
        "*Consequences, not causes: rank 0 then failed in a collective*",
    ])
    text = result.stdout.str()
    assert text.count("[rank1] ValueError: corrupt validation sample on rank 1") == 1  # its traceback, once
    assert "self.log" not in text
