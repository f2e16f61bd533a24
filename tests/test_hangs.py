"""A rank that stops making progress is diagnosed once: later runs of the same target that would reach
the same code are not started (session.py, ``hung_before``), and a failed rank's output is bounded.
"""

from __future__ import annotations

import json
import re

import pytest

from pytest_ltconform.sites import bounded_lines
from pytest_ltconform.world import JobResult, RankOutcome
from pytest_ltconform.world.causes import first_cause, stack_user_site

pytest_plugins = ["pytester"]

SLEEPY = '''
import time

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 1:
            time.sleep(3600)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def train_dataloader(self):
        x = torch.randn(32, 4)
        return DataLoader(TensorDataset(x, x[:, :1]), batch_size=4)

    def val_dataloader(self):
        x = torch.randn(16, 4)
        return DataLoader(TensorDataset(x, x[:, :1]), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
'''


def test_one_hung_rank_costs_one_timeout_not_one_per_item(pytester, no_leftover_ranks):
    pytester.makepyfile(sleepy=SLEEPY)
    pytester.syspathinsert()
    result = pytester.runpytest_subprocess(
        "--ltconform", "sleepy.Model", "--ltconform-strategies", "ddp,fsdp", "--ltconform-timeout", "10",
        "-m", "ltconform_cpu", "-k", "all-rank-save or sync-dist or eval-duplication or effective-batch",
        "-p", "no:cacheprovider", "-rA", "--ltconform-report", "hang.json")
    out = result.stdout.str()
    # The report and the summary table say what pytest says: the run item FAILED (it is not "not judged").
    records = json.loads((pytester.path / "hang.json").read_text())["results"]
    assert [r["outcome"] for r in records if r.get("run") and r["strategy"] == "ddp"] == ["failed"], records
    assert re.search(r"^fit +failed", out, re.M) and " not judged " not in out.split("ltconform summary")[1], \
        out[-4000:]
    assert re.search(r"failed \(each block is in FAILURES above\) \S*\nfit\[ddp\]: the run did not finish", out), \
        out[-4000:]
    # The fit[ddp] run item leads with the hang; all-rank-save[ddp] and sync-dist[ddp] share that fit and are
    # not judged; 5 items are never started (eval-duplication[ddp] and effective-batch[ddp] make runs of their
    # own, and the fit[fsdp] run item with the two [fsdp] contract items).
    result.assert_outcomes(failed=1, skipped=7)
    assert "rank 1 hung at sleepy.py:15 (training_step): it was still running at the timeout " \
           "(--ltconform-timeout=10) and was killed" in out, out[-4000:]
    # Each item left not judged names itself in -rs (its reason names another item).
    not_started = re.findall(
        r"^SKIPPED \[1\] ltconform::sleepy\.Model::(\S+): not judged: not started: the fit\[ddp\] run of this "
        r"target hung \(rank 1 at sleepy\.py:15 \(training_step\) stopped making progress until "
        r"--ltconform-timeout=10\), and this run would reach the same code \(see fit\[ddp\]\)\.$", out, re.M)
    assert sorted(not_started) == ["all-rank-save[fsdp]", "effective-batch[ddp]", "eval-duplication[ddp]",
                                   "fit[fsdp]", "sync-dist[fsdp]"], out[-4000:]
    # The peer's collective error is named once, as a consequence. Only the ERRORS section is counted:
    # pytest's short summary repeats the whole message when it runs on CI (the CI variable is set).
    body = out.split("short test summary info")[0]
    assert body.count("then failed in a collective") == 1, body[-4000:]
    assert "inside a collective whose peer" not in body, body[-4000:]


def _dump(frames: list[tuple[str, int, str]]) -> str:
    lines = ["Current thread 0x00007f (most recent call first):"]
    lines += [f'  File "{f}", line {n} in {fn}' for f, n, fn in frames]
    return "\n".join(lines)


def test_hung_rank_is_the_cause_and_its_own_line_is_named(tmp_path):
    user = str(tmp_path / "model.py")
    lib = pytest.__file__  # a library frame
    sleeping = _dump([(user, 16, "training_step"), (lib, 10, "run")])
    waiting = _dump([(lib, 3, "all_reduce"), (user, 20, "on_validation_epoch_end")])
    assert stack_user_site(sleeping) == ({"file": user, "line": 16, "func": "training_step"}, True)
    assert stack_user_site(waiting) == ({"file": user, "line": 20, "func": "on_validation_epoch_end"}, False)
    peer = RankOutcome(rank=0, status="error", exc_type="RuntimeError",
                       message="Application timeout caused pair closure")
    hung = RankOutcome(rank=1, status="hung", stack=sleeping)
    cause = first_cause(JobResult.of([peer, hung], 10.2, timeout_s=10, timed_out_by="--ltconform-timeout=10"))
    assert (cause.rank, cause.kind, cause.site["line"]) == (1, "hung", 16)
    assert cause.consequences == ["rank 0 then failed in a collective (RuntimeError: Application timeout caused "
                                  "pair closure)"]


def test_rank_output_is_bounded_and_names_no_frame_of_the_plugin():
    import pytest_ltconform.harness as harness

    tb = ["Traceback (most recent call last):",
          f'  File "{harness.__file__}", line 345, in traced_fit',
          "    trainer.fit(objects.model, datamodule=objects.datamodule)",
          "    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^"]
    for i in range(40):
        tb += [f'  File "/lib/site-packages/lightning/x{i}.py", line {i}, in f{i}', f"    call{i}()",
               "    ~~~~~~^^"]
    tb += ['  File "/home/u/model.py", line 7, in training_step', "    raise ValueError('bad')",
           "ValueError: bad"]
    shown = bounded_lines("\n".join(tb), limit=10)
    assert shown == ["Traceback (most recent call last):", "... (74 lines left out)",
                     '  File "/lib/site-packages/lightning/x37.py", line 37, in f37', "    call37()",
                     '  File "/lib/site-packages/lightning/x38.py", line 38, in f38', "    call38()",
                     '  File "/lib/site-packages/lightning/x39.py", line 39, in f39', "    call39()",
                     '  File "/home/u/model.py", line 7, in training_step', "    raise ValueError('bad')",
                     "ValueError: bad"]
    assert bounded_lines("a\nb") == ["a", "b"]


# -- the session: what a hung run means for the runs after it (fake runs, no world) -----------------

class _NoPool:
    fresh_per_job = False

    def get(self, *args, **kwargs):
        raise AssertionError("no run may be started")


def _session_with(fake_runs, hung_stack: str, strategy: str = "ddp"):
    from pytest_ltconform.session import LtconformSession
    from pytest_ltconform.settings import Settings

    ranks = [fake_runs.rank(0, status="error", exc_type="RuntimeError", message="Timed out waiting 5000ms for recv"),
             fake_runs.rank(1, status="hung", stack=hung_stack)]
    run = fake_runs.of(ranks, status="hung")
    run.job.timed_out_by = "--ltconform-timeout=10"
    run.strategy = strategy
    run.cause_item = f"all-rank-save[{strategy}]"
    session = LtconformSession(Settings(target="m.Model", world_size=2), target=None, pool=_NoPool())
    session._runs[session._key("fit", strategy, "cpu")] = run
    return session


def test_runs_after_a_hang_in_user_code_are_not_started_under_any_strategy(fake_runs, tmp_path):
    from pytest_ltconform.runs import FIT, inspection

    user = str(tmp_path / "model.py")
    session = _session_with(fake_runs, _dump([(user, 15, "training_step"), (pytest.__file__, 3, "run")]))
    verdict, _ = session.verdict("eval-duplication", "fsdp")
    assert verdict.outcome == "not_judged" and "\n" not in verdict.summary
    assert verdict.not_judged.reason.startswith("not started: the fit[ddp] run of this target hung (rank 1 at ")
    assert verdict.summary.endswith("model.py:15 (training_step) stopped making progress until "
                                    "--ltconform-timeout=10), and this run would reach the same code "
                                    "(see all-rank-save[ddp]).")
    # A run that trains nothing cannot reach the hung step: it is started.
    assert session.hung_before(inspection("config"), "ddp", "cpu") is None
    assert session.hung_before(FIT, "ddp", "gpu") is None  # another tier: its own world


def test_a_rank_stuck_in_a_library_call_blocks_only_its_own_strategy(fake_runs, tmp_path):
    from pytest_ltconform import contracts

    user = str(tmp_path / "model.py")
    session = _session_with(fake_runs, _dump([(pytest.__file__, 3, "all_reduce"), (user, 20, "on_validation_end")]))
    evaluation = contracts.get_contract("eval-duplication").run_spec
    assert session.hung_before(evaluation, "ddp", "cpu") is not None
    assert session.hung_before(evaluation, "fsdp", "cpu") is None  # may be DDP's doing: FSDP still runs


def test_a_run_killed_before_its_time_limit_for_a_hung_rank_is_not_run_into_again(fake_runs, tmp_path):
    # The peer gave up in its collective at the group's timeout and the hung rank was killed some seconds
    # later, long before --ltconform-timeout: the next run of the target would sleep in the same step.
    user = str(tmp_path / "model.py")
    session = _session_with(fake_runs, _dump([(user, 15, "training_step"), (pytest.__file__, 3, "run")]))
    fit = session._runs[session._key("fit", "ddp", "cpu")]
    fit.job.timed_out_by = None
    fit.job.killed_early = "40 s after rank(s) 0 failed, before the time limit (--ltconform-timeout=120)"
    verdict, _ = session.verdict("eval-duplication", "ddp")
    assert verdict.outcome == "not_judged", verdict.summary
    assert verdict.summary.endswith("model.py:15 (training_step) stopped making progress and was killed 40 s after "
                                    "rank(s) 0 failed, before the time limit (--ltconform-timeout=120)), and this run "
                                    "would reach the same code (see all-rank-save[ddp]).")


def test_a_rank_killed_before_the_time_limit_is_named_with_it(tmp_path):
    peer = RankOutcome(rank=0, status="error", exc_type="DistBackendError",
                       message="Timed out waiting 30000ms for recv")
    hung = RankOutcome(rank=1, status="hung", stack=_dump([(str(tmp_path / "model.py"), 7, "training_step")]))
    early = "40 s after rank(s) 0 failed, before the time limit (--ltconform-timeout=120)"
    result = JobResult.of([peer, hung], 70.5, timeout_s=120, killed_early=early)
    assert first_cause(result).message == f"it was still running {early}, and was killed"
    assert f"were still running after 70.5 s and were killed (SIGKILL) {early}." in result.diagnosis


@pytest.mark.slow
def test_a_hang_killed_before_the_time_limit_costs_one_run(pytester, no_leftover_ranks):
    """--ltconform-timeout 80: the collective timeout is 20 s, so rank 0 gives up waiting for the sleeping
    rank 1 and the world is killed some 30 s later, before the limit; the evaluation run is not started."""
    pytester.makepyfile(sleepy=SLEEPY)
    pytester.syspathinsert()
    result = pytester.runpytest_subprocess(
        "--ltconform", "sleepy.Model", "--ltconform-strategies", "ddp", "--ltconform-timeout", "80",
        "-m", "ltconform_cpu", "-k", "all-rank-save or eval-duplication", "-p", "no:cacheprovider", "-rA")
    out = result.stdout.str()
    result.assert_outcomes(errors=1, skipped=1)
    assert re.search(r"rank 1 hung at sleepy\.py:15 \(training_step\): it was still running \d+ s after rank\(s\) 0 "
                     r"failed, before the time limit \(--ltconform-timeout=80\), and was killed", out), out[-4000:]
    assert re.search(r"^SKIPPED \[1\] ltconform::sleepy\.Model::eval-duplication\[ddp\]: not judged: not started: "
                     r"the fit\[ddp\] run of this target hung .*--ltconform-timeout=80\)\), and this run would reach "
                     r"the same code \(see all-rank-save\[ddp\]\)\.$", out, re.M), out[-4000:]


def _raised(fn):
    try:
        fn()
    except Exception as exc:
        return exc
    raise AssertionError("did not raise")


def test_a_library_error_raised_while_handling_another_is_not_the_lead():
    """Issue 38 §2: Lightning's teardown raises "Please call `iter(combined_loader)` first" while
    the DataLoader workers' pickling error is being handled: the report leads with the root."""
    import json

    from pytest_ltconform.world.rank import _leading_error

    def library_during_handling():
        try:
            raise AttributeError("Can't pickle local object 'Model.train_dataloader.<locals>.init_worker'")
        except AttributeError:
            json.loads("{")  # raises from the standard library (not user code) while handling it

    lead = _leading_error(_raised(library_during_handling))
    assert isinstance(lead, AttributeError) and "Can't pickle" in str(lead)

    def user_reraises():
        try:
            {}["k"]
        except KeyError:
            raise ValueError("missing key k")  # noqa: B904 - the user's own raise while handling

    def chained_on_purpose():
        try:
            json.loads("{")
        except ValueError as exc:
            raise RuntimeError("bad config") from exc

    assert isinstance(_leading_error(_raised(user_reraises)), ValueError)
    assert isinstance(_leading_error(_raised(chained_on_purpose)), RuntimeError)
