"""The session's judgement of a run that stopped: the first cause leads, consequences say so once
(docs/internals.md, "When a world does not finish")."""

from __future__ import annotations

import pytest

from pytest_ltconform import contracts
from pytest_ltconform.outcomes import Outcome
from pytest_ltconform.policies import judge
from pytest_ltconform.world.causes import first_cause, is_transport_failure

USER_FILE = __file__
TRACEBACK = (
    'Traceback (most recent call last):\n'
    '  File "/site/lightning/pytorch/loops/fit_loop.py", line 10, in run\n    self.advance()\n'
    f'  File "{USER_FILE}", line 42, in training_step\n    raise ValueError("bad sample 7")\n'
    'ValueError: bad sample 7\n'
)
PEER = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:7361. This is typically caused by a remote worker crashing.")


def _crashed_run(fake_runs):
    ranks = [fake_runs.rank(0, status="error", exc_type="RuntimeError", message=PEER, traceback="..."),
             fake_runs.rank(1, status="error", exc_type="ValueError", message="bad sample 7", traceback=TRACEBACK)]
    return fake_runs.of(ranks, status="error")


def test_the_rank_that_raised_on_its_own_is_the_cause(fake_runs):
    run = _crashed_run(fake_runs)
    assert is_transport_failure(run.job.ranks[0]) and not is_transport_failure(run.job.ranks[1])
    cause = first_cause(run.job)
    assert cause.rank == 1 and cause.site["line"] == 42 and cause.site["func"] == "training_step"
    assert cause.headline().startswith("rank 1 raised ValueError at ")
    assert "test_session.py:42 (training_step): bad sample 7" in cause.headline()
    assert "rank 0 then failed in a collective (RuntimeError" in cause.consequence_line()


def test_one_item_shows_the_cause_and_the_others_name_it_in_one_line(fake_runs):
    run = _crashed_run(fake_runs)
    first = judge(contracts.get_contract("all-rank-save"), run)
    assert first.outcome == "error" and first.category == "crash"
    assert first.summary.startswith("the run did not finish: rank 1 raised ValueError at ")
    assert "bad sample 7" in first.diagnosis and "Consequences, not causes: rank 0" in first.diagnosis
    assert "Connection closed by peer" not in first.summary
    later = [judge(contracts.get_contract(cid), run) for cid in ("sync-dist", "data-sharding", "unused-parameters")]
    for verdict in later:
        assert verdict.outcome == "not_judged" and verdict.diagnosis is None
        assert verdict.not_judged.reason.startswith("the shared fit run did not finish because rank 1 raised "
                                          "ValueError at ")
        assert verdict.summary.endswith("(see all-rank-save[ddp]).")
        assert "\n" not in verdict.render()


def test_ranks_that_each_raised_the_same_error_are_no_consequence_of_one_another(fake_runs):
    """Issue 38 §4: both ranks raised the same TypeError at the same line, each on its own (a
    DeepSpeed config read the same way everywhere): no "Consequences, not causes" for rank 1."""
    ranks = [fake_runs.rank(r, status="error", exc_type="ValueError", message="bad sample 7", traceback=TRACEBACK)
             for r in (0, 1)]
    cause = first_cause(fake_runs.of(ranks, status="error").job)
    assert cause.alike == [1] and not cause.consequences
    assert cause.headline().startswith("ranks 0 and 1 each raised ValueError at ")
    line = cause.consequence_line()
    assert "rank 1 raised the same ValueError at the same line on its own" in line and "Consequences" not in line
    other = TRACEBACK.replace("line 42", "line 50").replace("bad sample 7", "other")
    ranks[1] = fake_runs.rank(1, status="error", exc_type="ValueError", message="other", traceback=other)
    cause = first_cause(fake_runs.of(ranks, status="error").job)
    assert not cause.alike and "Also on its own: rank 1 raised ValueError: other" in cause.consequence_line()


def test_a_rank_that_died_leads_over_its_peers_transport_errors(fake_runs):
    ranks = [fake_runs.rank(0, status="error", exc_type="RuntimeError", message="Timed out waiting 10000ms for recv"),
             fake_runs.rank(1, status="died", exit_code=137)]
    cause = first_cause(fake_runs.of(ranks, status="died").job)
    assert cause.rank == 1 and cause.kind == "died" and "exit code 137" in cause.headline()


def test_uneven_hooks_of_a_stopped_rank_are_not_claimed_by_data_sharding(fake_runs):
    # Rank 1 stopped in epoch 1 after raising; the ranks' hooks differ but their data is even.
    batches = fake_runs.batches([["a"], ["b"]], epoch=0)
    ranks = [fake_runs.rank(0, trace=batches, status="error", exc_type="RuntimeError", message=PEER),
             fake_runs.rank(1, trace=fake_runs.batches([["c"], ["d"]], epoch=0), status="error",
                            exc_type="ValueError", message="bad sample 7", traceback=TRACEBACK)]
    run = fake_runs.of(ranks, status="error", divergence={"kind": "hooks", "h": 9, "hook": {}, "events": {}})
    assert contracts.blamed(run) is None


def _explained_by_fit(session, tier: str):
    """The policy that points an errored eval-duplication item under ddp at the fit's item, asked of ``session``."""
    from pytest_ltconform import policies

    contract = contracts.get_contract("eval-duplication")
    case = policies.Case(contract, "ddp", tier, session=session)
    return policies._explained_by_fit(case, contract.verdict(Outcome.ERROR, "the run did not finish"))


def test_a_run_that_stops_like_the_fit_names_the_fit_item_instead_of_a_second_traceback(fake_runs):
    from pytest_ltconform.session import LtconformSession
    from pytest_ltconform.settings import Settings

    fit = _crashed_run(fake_runs)
    assert judge(contracts.get_contract("all-rank-save"), fit).outcome == "error"  # shows the traceback once
    evaluation = _crashed_run(fake_runs)
    evaluation.kind = contracts.get_contract("eval-duplication").run_spec.name
    session = LtconformSession(Settings(target="m.Model", world_size=2), target=None, pool=object())
    session._runs.update({session._key("fit", "ddp", "cpu"): fit,
                          session._key(evaluation.kind, "ddp", "cpu"): evaluation})
    verdict = _explained_by_fit(session, "cpu")
    assert verdict.outcome == "not_judged" and verdict.diagnosis is None
    assert verdict.not_judged.reason.startswith("its own run stopped the same way as the fit: rank 1 raised "
                                      "ValueError at ")
    assert verdict.summary.endswith("test_session.py:42 (training_step): bad sample 7 (see all-rank-save[ddp]).")
    # A different failure in its own run is its own to show.
    evaluation.job.ranks[1].traceback = TRACEBACK.replace("line 42", "line 50")
    assert _explained_by_fit(session, "cpu") is None


def test_a_gpu_item_is_not_explained_by_the_cpu_fit(fake_runs):
    # The runs of one tier say nothing about another tier's: each tier has its own world and fit.
    from pytest_ltconform.runs import RunKey
    from pytest_ltconform.session import LtconformSession
    from pytest_ltconform.settings import Settings
    from pytest_ltconform.world.layout import Layout

    two = Layout(1, 2)

    fit = _crashed_run(fake_runs)
    judge(contracts.get_contract("all-rank-save"), fit)
    evaluation = _crashed_run(fake_runs)
    evaluation.kind = contracts.get_contract("eval-duplication").run_spec.name
    session = LtconformSession(Settings(target="m.Model", world_size=2), target=None, pool=object())
    session._runs.update({RunKey("-", "fit", "ddp", "cpu", two): fit,
                          RunKey("-", evaluation.kind, "ddp", "cpu", two): evaluation})
    assert _explained_by_fit(session, "cpu") is not None
    assert _explained_by_fit(session, "gpu") is None
    assert session._key("fit", "ddp", "gpu") == RunKey("-", "fit", "ddp", "gpu", two) != \
        session._key("fit", "ddp", "cpu")


# -- a pass that judged nothing: not judged when the world stopped, kept when it finished ----------

STEP = {"ev": "hook", "i": 1, "h": 1, "name": "[LightningModule]Model.training_step", "epoch": 0, "step": 0}
OWNED = {"ev": "raised", "owner": "all-rank-save"}  # a failure all-rank-save's probe named its own


def _stopped_after_a_step(fake_runs, kind="fit", extra=()):
    ranks = [fake_runs.rank(r, trace=[STEP, *extra, OWNED], status="error", exc_type="RuntimeError",
                            message="one-sided save") for r in range(2)]
    return fake_runs.of(ranks, status="error", kind=kind)


@pytest.mark.parametrize("cid", ["eval-duplication", "unused-parameters", "data-sharding", "sync-dist"])
def test_a_contract_that_recorded_nothing_before_the_stop_is_not_judged(fake_runs, cid):
    contract = contracts.get_contract(cid)
    run = _stopped_after_a_step(fake_runs, kind=contract.run_spec.name)
    assert contracts.blamed(run) == "all-rank-save"
    verdict = judge(contract, run)
    assert verdict.outcome == "not_judged" and verdict.category == "consequence" and not verdict.partial
    assert verdict.not_judged.depends_on == "all-rank-save[ddp]"
    assert verdict.summary == (f"not judged: the shared {run.kind} run stopped because of the all-rank-save[ddp] "
                               f"failure before anything this contract judges was recorded (see that item).")


def test_a_contract_that_recorded_what_it_judges_passes_on_the_part_before_the_stop(fake_runs):
    log = {"ev": "log", "name": "loss", "hook": "training_step", "sync_dist": True, "rank_zero_only": False}
    verdict = judge(contracts.get_contract("sync-dist"), _stopped_after_a_step(fake_runs, extra=[log]))
    assert verdict.outcome == "passed" and verdict.partial and "all-rank-save[ddp]" in verdict.notes[-1]


@pytest.mark.parametrize("cid", ["eval-duplication", "unused-parameters", "sync-dist"])
def test_a_finished_run_with_nothing_to_judge_keeps_its_pass(fake_runs, cid):
    contract = contracts.get_contract(cid)
    run = fake_runs.run(traces=[[STEP], [STEP]], values=[{}, {}], kind=contract.run_spec.name)
    verdict = judge(contract, run)
    assert verdict.outcome == "passed" and verdict.empty and not verdict.partial


def test_a_stop_inside_validation_or_its_sanity_check_is_told_from_one_in_training(fake_runs):
    from pytest_ltconform.policies import stopped_in_validation as _stopped_in_validation

    def stopped(*events):
        return _stopped_in_validation(fake_runs.run(traces=[list(events), [STEP]], values=[{}, {}]))

    sanity = {"ev": "hook", "i": 1, "name": "[LightningModule]Model.validation_step", "epoch": 0, "step": 0,
              "sanity": True}
    assert stopped(sanity)
    closed = {"ev": "hook_exit", "i": 1, "epoch": 0, "step": 0, "sanity": False}
    train = {"ev": "hook", "i": 2, "name": "[LightningModule]Model.training_step", "epoch": 0, "step": 0,
             "sanity": False}
    assert not stopped(sanity, closed, train)
    val_end = {"ev": "hook", "i": 3, "name": "[LightningModule]Model.on_validation_epoch_end", "epoch": 1,
               "step": 8, "sanity": False}
    assert stopped(sanity, closed, train, {"ev": "hook_exit", "i": 2}, val_end)


def test_the_run_item_of_a_finished_run_says_what_ran(fake_runs):
    # A pass that records a run says what the run did, not only that it finished.
    from pytest_ltconform.policies import what_ran as _what_ran

    def step(epoch):
        return {"ev": "hook", "name": "[LightningModule]M.training_step", "epoch": epoch, "step": 0}

    trace = [{"ev": "stage", "name": "fit"}, step(0), step(0), step(1), step(1), {"ev": "stage", "name": "test"},
             {"ev": "stage", "name": "predict"}, {"ev": "stage_error", "name": "predict", "exc_type": "KeyError"}]
    run = fake_runs.of([fake_runs.rank(0, trace=trace), fake_runs.rank(1, trace=trace)])
    assert _what_ran(run) == ("the run finished on 2 ranks: fit (4 training step(s) over 2 epoch(s) on rank 0), "
                              "then test, predict (it raised KeyError)")


def test_each_run_seeds_its_ranks_as_the_setting_says():
    """Issue 38 §1: the traced fits follow --ltconform-seeding; a run compared with a one-rank
    reference seeds every rank alike (the reference, seeded as rank 0, reproduces each rank)."""
    from pytest_ltconform.runs import FIT, FIT_WITHOUT_VALIDATION, RunSpec, inspection, seeding_for
    from pytest_ltconform.world.rank import rank_seed

    evaluation = RunSpec("eval", "m:f", reference="m:ref")
    for mode in ("both", "same", "per-rank"):
        assert seeding_for(FIT, mode) == seeding_for(FIT_WITHOUT_VALIDATION, mode) == mode
        assert seeding_for(evaluation, mode) == "same"
    assert seeding_for(inspection("spawn"), "both") == "same"
    assert seeding_for(inspection("spawn"), "per-rank") == "per-rank"
    assert [rank_seed(0, "both", r) for r in range(3)] == [0, 1, 2]
    assert [rank_seed(5, "same", r) for r in range(3)] == [5, 5, 5]


def _fsdp_stop(fake_runs, message: str, raised_in: str, exc_type: str = "RuntimeError"):
    from pytest_ltconform.contracts.base import Run

    tb = ('Traceback (most recent call last):\n'
          f'  File "{USER_FILE}", line 17, in training_step\n    self.manual_backward(loss)\n'
          f'  File "{raised_in}", line 164, in _p_assert\n    raise AssertionError(s)\n'
          f'{exc_type}: {message}\n')
    ranks = [fake_runs.rank(r, status="error", exc_type=exc_type, message=message, traceback=tb) for r in range(2)]
    return Run(fake_runs.job(ranks, status="error"), "fsdp", "fit")


def test_a_sharded_skip_says_on_cpu_only_when_the_failure_is_particular_to_cpu_ranks(fake_runs):
    """Issue 32, section 3: "does not run under FSDP on CPU" blamed the machine for the user's own
    fault (manual backward inside the FSDP-wrapped step): the cause and its lines are named instead."""
    import torch.distributed.utils as torch_utils

    import pytest_ltconform.sharded as plugin_file
    from pytest_ltconform.policies import not_a_sharded_module as _not_a_sharded_module

    contract = contracts.get_contract("sync-dist")
    users = _not_a_sharded_module(contract, _fsdp_stop(fake_runs, "Expects `BACKWARD_PRE` or `BACKWARD_POST` state "
                                                                  "but got HandleTrainingState.FORWARD",
                                                       torch_utils.__file__, "AssertionError"))
    assert users.summary.startswith("the module does not run under FSDP (AssertionError in library code at "
                                    "torch/distributed/utils.py:164 (_p_assert), from your code at ")
    assert "test_session.py:17 (training_step): Expects `BACKWARD_PRE`" in users.summary
    assert "on CPU" not in users.summary
    gloo = _not_a_sharded_module(contract, _fsdp_stop(fake_runs, "ProcessGroupGloo does not support reduce_scatter",
                                                      torch_utils.__file__))
    assert gloo.summary.startswith("the module does not run under FSDP on CPU gloo ranks (RuntimeError in library code")
    assert "; the error names 'ProcessGroupGloo')" in gloo.summary
    ours = _not_a_sharded_module(contract, _fsdp_stop(fake_runs, "bad shard", plugin_file.__file__))
    assert "on CPU gloo ranks (RuntimeError in the plugin's code at pytest_ltconform/sharded.py:164 (_p_assert)" \
        in ours.summary
    assert "the plugin's CPU stand-in raised it, in pytest_ltconform/sharded.py:164 (_p_assert))" in ours.summary


def test_a_deepspeed_skip_names_lightnings_frame_and_the_users_object_not_the_cpu(fake_runs):
    """Trial (iteration_batch_sampler_not_distributed.py): a batch sampler without ``batch_size``
    stops Lightning's DeepSpeedStrategy, which reads it to fill train_micro_batch_size_per_gpu on
    any device; the skip said "does not run under DeepSpeed on CPU". It names Lightning's frame and
    the user's object, and says nothing of the CPU."""
    from pathlib import Path

    import lightning.pytorch.strategies.deepspeed as ds_file

    from pytest_ltconform.contracts.base import Run
    from pytest_ltconform.policies import not_a_sharded_module as _not_a_sharded_module

    message = "'IterationBasedBatchSampler' object has no attribute 'batch_size'"
    tb = ('Traceback (most recent call last):\n'
          f'  File "{ds_file.__file__}", line 944, in _auto_select_batch_size\n'
          '    return train_dataloader.batch_sampler.batch_size\n'
          f'AttributeError: {message}\n')
    ranks = [fake_runs.rank(r, status="error", exc_type="AttributeError", message=message, traceback=tb)
             for r in range(2)]
    run = Run(fake_runs.job(ranks, status="error"), "deepspeed", "fit")
    skipped = _not_a_sharded_module(contracts.get_contract("sync-dist"), run)
    assert skipped.summary.startswith(
        "the module does not run under DeepSpeed (AttributeError in library code at "
        f"lightning/pytorch/strategies/{Path(ds_file.__file__).name}:944 (_auto_select_batch_size), with no frame "
        f"of your code on the way: {message});"), skipped.summary
    assert "on CPU" not in skipped.summary


def test_a_later_stage_that_raised_is_named_with_its_cause_and_lines(fake_runs):
    import torch.nn.functional as F

    from pytest_ltconform.policies import what_ran as _what_ran

    error = {"ev": "stage_error", "name": "test", "exc_type": "RuntimeError", "message": "'weight' must be 2-D",
             "raised": {"file": F.__file__, "line": 2615, "func": "embedding"},
             "user": {"file": USER_FILE, "line": 19, "func": "forward"}}
    trace = [{"ev": "stage", "name": "fit"}, {"ev": "stage", "name": "test"}, error]
    run = fake_runs.of([fake_runs.rank(0, trace=trace), fake_runs.rank(1, trace=trace)])
    text = _what_ran(run)
    assert text.startswith("the run finished on 2 ranks: fit, then test (it raised RuntimeError in library code at "
                           "torch/nn/functional.py:2615 (embedding), from your code at ")
    assert text.endswith("test_session.py:19 (forward): 'weight' must be 2-D)")


GLOO = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:446] Received data size doesn't match expected "
        "size: 64 vs 48")


def _replay_that_hung(fake_runs, kind: str):
    """Rank 0 raised inside the step (Lightning's on_exception recorded it), then hung in the
    teardown's collective; rank 1 got gloo's size mismatch: the world of the plugin's own run."""
    import lightning.pytorch.trainer.call as call
    import torch.distributed.distributed_c10d as c10d

    recorded = {"ev": "exception", "exc_type": "TypeError", "message": "'NoneType' object is not callable",
                "raised": {"file": USER_FILE, "line": 77, "func": "energy"}, "user": {"file": USER_FILE, "line": 77,
                                                                                       "func": "energy"}}
    stack = ("Thread 0x1 (most recent call first):\n"
             f'  File "{c10d.__file__}", line 4287 in barrier\n'
             f'  File "{call.__file__}", line 60 in _call_and_handle_interrupt\n')
    ranks = [fake_runs.rank(0, trace=[recorded], status="hung", stack=stack),
             fake_runs.rank(1, status="error", exc_type="DistBackendError", message=GLOO, traceback="...")]
    return fake_runs.of(ranks, status="hung", kind=kind)


def test_a_stop_of_the_plugins_own_run_names_the_run_the_exception_and_whether_your_config_reaches_it(fake_runs):
    """Issue 32, section 4: an effective-batch replay that stopped read 'NOT JUDGED (the run stopped
    in your code): rank 0 hung' with no exception and no line."""
    from pytest_ltconform import policies
    from pytest_ltconform.session import LtconformSession
    from pytest_ltconform.settings import Settings

    contract = contracts.get_contract("effective-batch")
    replay = _replay_that_hung(fake_runs, contract.run_spec.name)
    first = judge(contract, replay)
    assert first.outcome == "error" and "NOT JUDGED (the run stopped in your code)" not in first.render()
    assert first.render().startswith("[effective-batch] NOT JUDGED (the run stopped while a rank waited in library "
                                     "code): the run did not finish: rank 0 hung in library code at "
                                     "torch/distributed/distributed_c10d.py:4287 (barrier): it was still running")
    assert ", after it raised TypeError in your code at " in first.summary
    assert "test_session.py:77 (energy): 'NoneType' object is not callable" in first.summary
    session = LtconformSession(Settings(target="m.Model", world_size=2), target=None, pool=object())
    fit = fake_runs.of([fake_runs.rank(0), fake_runs.rank(1)])
    session._runs[session._key("fit", "ddp", "cpu")] = fit

    def own_run_stopped(contract):
        return policies._own_run_stopped(policies.Case(contract, "ddp", "cpu", session=session, run=replay), first)

    verdict = own_run_stopped(contract)
    assert verdict.outcome == "not_judged" and verdict.category is None
    assert verdict.not_judged.reason.startswith("the plugin's effective-batch replay (one optimizer step on every "
                                                "rank, then the same samples in one batch on one rank) stopped: "
                                                "rank 0 hung in library code at ")
    assert verdict.not_judged.reason.endswith("; your config's traced fit[ddp] finished without it, so this stop is "
                                              "the plugin's own run's, not a finding.")
    assert "Received data size doesn't match expected size" in verdict.diagnosis  # rank 1's, as a consequence
    del session._runs[session._key("fit", "ddp", "cpu")]
    unknown = own_run_stopped(contract)
    assert "whether your config reaches that code is not known here" in unknown.summary
    # The user's own config (the traced fit) keeps its error item: the session says where it stopped.
    assert own_run_stopped(contracts.get_contract("sync-dist")) is None


def test_a_rank_that_died_names_what_its_abort_printed(fake_runs):
    tail = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
            "  what():  [enforce fail at pair.cc:446] op.preamble.length <= op.nbytes. 64 vs 48\n")
    ranks = [fake_runs.rank(0, status="died", exit_code=-6, log_tail=tail),
             fake_runs.rank(1, status="error", exc_type="DistBackendError", message=GLOO, traceback="...")]
    cause = first_cause(fake_runs.of(ranks, status="died").job)
    assert cause.headline() == ("rank 0 died: it exited without a result (killed by SIGABRT (exit code -6)); its "
                                "output ends with '[enforce fail at pair.cc:446] op.preamble.length <= op.nbytes. "
                                "64 vs 48'")


def test_the_run_item_of_a_sharded_run_the_config_does_not_ask_for_carries_its_claims(fake_runs):
    """The run's own item (fit[fsdp]) says what the contract items say of a sharded run that
    stopped ("does not run under FSDP on CPU"), and its report record carries the claim that
    sentence rests on, so the consistency check holds it as it holds a contract item's."""
    import torch.distributed.utils as torch_utils

    from pytest_ltconform import claims, policies, report

    sharded = _fsdp_stop(fake_runs, "ProcessGroupGloo does not support reduce_scatter", torch_utils.__file__)
    ddp = fake_runs.run([[], []])
    case = policies.Case(contracts.get_contract("all-rank-save"), "fsdp", run=sharded, ddp=ddp, item="fit[fsdp]")
    said = policies.run_record(case)
    assert said.outcome is Outcome.SKIPPED
    assert said.text.startswith("the module does not run under FSDP on CPU gloo ranks")
    assert [(c.kind, c.facts) for c in said.claims] == [("cpu-only", {"ddp": "finished"})]

    def record(claimed):
        return report.record("fit", "fsdp", 2, {"outcome": said.outcome, "message": said.text, "summary": said.text,
                                                "claims": [c.as_dict() for c in claimed]}, 0.0)

    assert claims.check(record(said.claims)) == []
    assert any(p.startswith("cpu-only:") for p in claims.check(record(())))  # the check sees the sentence


def _deepspeed_dir_stop(fake_runs, user_saves: str):
    """A DeepSpeed run whose user callback torch.loads the best checkpoint, a ZeRO directory there."""
    from pytest_ltconform.contracts.base import Run

    site = {"file": USER_FILE, "line": 30, "func": "RestoreBest.on_fit_end"}
    load = {"ev": "load", "label": "torch.load", "path": "/tmp/run/checkpoints/epoch=1-step=8.ckpt",
            "layout": "deepspeed", "files": ["checkpoint", "latest"], "site": site, "user": True,
            "hook": "RestoreBest.on_fit_end", "user_saves": user_saves}
    raised = {"ev": "raised", "in": "torch.load", "owner": "all-rank-save",
              "exc": "IsADirectoryError: [Errno 21] Is a directory"}
    tb = ('Traceback (most recent call last):\n'
          f'  File "{USER_FILE}", line 30, in on_fit_end\n    state = torch.load(best)\n'
          'IsADirectoryError: [Errno 21] Is a directory\n')
    ranks = [fake_runs.rank(r, [dict(load), dict(raised)], status="error", exc_type="IsADirectoryError",
                            message="[Errno 21] Is a directory", traceback=tb) for r in range(2)]
    return Run(fake_runs.job(ranks, status="error"), "deepspeed", "fit")


def test_a_stop_that_follows_from_the_plugins_save_format_is_not_judged_on_every_item(fake_runs):
    """Issue 32 section 4: a DDP config's callback torch.loads its best checkpoint; the plugin's own
    DeepSpeed tier saved a ZeRO directory there. Every item of that run is not judged, naming both
    formats; all-rank-save adds the advisory; the run item says the same. The user's own DeepSpeed
    config saving that directory is the user's fault (all-rank-save claims it)."""
    from pytest_ltconform import policies

    run = _deepspeed_dir_stop(fake_runs, "file")
    advisories = {}
    for cid in ("all-rank-save", "sync-dist"):
        case = policies.Case(contracts.get_contract(cid), "deepspeed", run=run)
        assert case.owner is None  # all-rank-save does not claim a stop of the plugin's own choosing
        verdict = policies._plugin_choice_item(case)
        # A strategy the config does not name: skipped (as a sharded stop is), saying why it is not judged.
        assert verdict.outcome is Outcome.SKIPPED, (cid, verdict.summary)
        assert verdict.summary.startswith("the plugin's DeepSpeed run saved a DeepSpeed checkpoint directory "
                                          "(per-rank ZeRO shards) where your config saves one checkpoint file, and "
                                          "torch.load at ")
        assert verdict.summary.endswith("not from your config, so this item is not judged; the Trainer config does "
                                        "not name DeepSpeed, so the deepspeed tier does not apply "
                                        "(--ltconform-strategies without deepspeed hides it).")
        assert "test_session.py:30 (RestoreBest.on_fit_end) was given it (it raised IsADirectoryError" in \
            verdict.summary
        assert "does not run under" not in verdict.summary
        advisories[cid] = [n for n in verdict.notes if n.startswith("advisory:")]
    assert advisories["sync-dist"] == []
    assert len(advisories["all-rank-save"]) == 1
    assert "breaks once your strategy saves a DeepSpeed checkpoint directory" in advisories["all-rank-save"][0]
    names = [p.name for p in policies.POLICIES]
    assert names.index("the stop follows from a format the plugin chose") < \
        names.index("a sharded run the config does not ask for stopped")
    record = policies.run_record(policies.Case(contracts.get_contract("all-rank-save"), "deepspeed", run=run,
                                               item="fit[deepspeed]"))
    assert record.outcome is Outcome.SKIPPED and "the plugin's DeepSpeed run saved" in record.text
    assert [(c.kind, c.facts) for c in record.claims] == [
        ("plugin-format", {"saved": "deepspeed", "theirs": "file", "strategy": "deepspeed"})]
    from pytest_ltconform import claims, report

    def as_row(claimed):
        return report.record("fit", "deepspeed", 2, {"outcome": record.outcome, "message": record.text,
                                                     "summary": record.text,
                                                     "claims": [c.as_dict() for c in claimed]}, 0.0)

    assert claims.check(as_row(record.claims)) == []
    assert any(p.startswith("plugin-format:") for p in claims.check(as_row(())))  # the check sees the sentence
    assert contracts.plugin_choice(_deepspeed_dir_stop(fake_runs, "deepspeed")) is None
    assert contracts.plugin_choice(_deepspeed_dir_stop(fake_runs, "file"))[0] == "all-rank-save"
