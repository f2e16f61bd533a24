"""all-rank-save's rules on hand-made runs and its rank-side taps, without starting a world."""

from __future__ import annotations

import json
import pickle

import pytest

from pytest_ltconform.contracts.all_rank_save import CONTRACT, call_guard, first_cause, fix_for, probe, taps
from pytest_ltconform.contracts.base import Blame
from pytest_ltconform.outcomes import Outcome
from pytest_ltconform.trace import Recorder
from pytest_ltconform.world.diagnose import first_divergence

CALLBACK = '''
class Preview:
    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            logits = trainer.model(x)
        trainer.strategy.barrier()

    def on_validation_epoch_end(self):
        metrics = {}
        if len(self.box_iou.ious) > 0:
            metrics["iou"] = self.box_iou.compute()
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "user_case.py"
    path.write_text(CALLBACK)
    return str(path)


def _site(path, line, func):
    return {"file": path, "line": line, "func": func}


def _call(label, site, h=1, seq=2, **extra):
    return {"ev": "call", "kind": extra.pop("kind", "strategy"), "op": extra.pop("op", label.rsplit(".", 1)[-1]),
            "label": label, "site": site, "user": True, "parent": None, "hook": "Preview.on_train_epoch_end",
            "seq": seq, "h": h, "epoch": 0, "step": 4, **extra}


def _hooked(name, calls, finished=True):
    trace = [{"ev": "hook", "i": 1, "name": f"[Callback]{name}", "h": 1, "seq": 1}] + calls
    return trace + ([{"ev": "hook_exit", "i": 1, "h": 1}] if finished else [])


def _run(fake_runs, traces, finished=True, values=None):
    div = first_divergence(traces)
    ranks = [fake_runs.rank(r, traces[r], (values or [None] * len(traces))[r],
                            status="ok" if finished else "hung") for r in range(len(traces))]
    return fake_runs.of(ranks, status="ok" if finished else "hung", divergence=div)


def _forward(path):
    return _call("DistributedDataParallel.forward", _site(path, 5, "Preview.on_train_epoch_end"), kind="ddp",
                 op="ddp_forward", effect="broadcasts buffers")


def _barrier(path, seq=3):
    return _call("strategy.barrier", _site(path, 6, "Preview.on_train_epoch_end"), seq=seq)


def test_ddp_forward_blamed_before_the_barrier_that_follows(fake_runs, user_file):
    """Rank 0's forward through the wrapper is the first cause; rank 1's barrier is where it waited."""
    traces = [_hooked("Preview.on_train_epoch_end", [_forward(user_file), _barrier(user_file)]),
              _hooked("Preview.on_train_epoch_end", [_barrier(user_file, seq=2)])]
    run = _run(fake_runs, traces)
    verdict = CONTRACT.judge(run)
    assert verdict.outcome == "failed"
    assert verdict.summary.startswith("DistributedDataParallel.forward (broadcasts buffers) called on rank 0 only "
                                      "(rank 0: 1 call, rank 1: 0 calls) from Preview.on_train_epoch_end under an "
                                      "`if trainer.is_global_zero:` guard, at ")
    assert "user_case.py:5 (Preview.on_train_epoch_end)" in verdict.summary
    assert verdict.fix.startswith("run rank-0-only inference on the unwrapped module (pl_module or "
                                  "trainer.model.module), or run it on every rank")
    assert "call the barrier" not in verdict.fix
    assert any("rank 1 went on to strategy.barrier()" in n and "not its cause" in n for n in verdict.notes)


def test_ddp_forward_blamed_when_both_ranks_hang(fake_runs, user_file):
    """Hung: rank 0 never reached its barrier; the guarded forward still wins over rank 1's barrier."""
    traces = [_hooked("Preview.on_train_epoch_end", [_forward(user_file)], finished=False),
              _hooked("Preview.on_train_epoch_end", [_barrier(user_file, seq=2)], finished=False)]
    run = _run(fake_runs, traces, finished=False)
    assert CONTRACT.blames(run) == Blame.CALL
    rank, call, at = first_cause(run.job.divergence["events"])
    assert (rank, call["label"], at) == (0, "DistributedDataParallel.forward", 0)
    verdict = CONTRACT.judge(run)
    assert "(rank 0: 1+ calls, rank 1: 0+ calls)" in verdict.summary
    assert "the world did not finish" in verdict.notes[-1]


def test_metric_compute_gated_on_local_state(fake_runs, user_file):
    site = _site(user_file, 11, "Preview.on_validation_epoch_end")
    compute = _call("BoxIoU.compute", site, kind="metric", op="metric_sync", effect="all-gathers the metric state",
                    metric="BoxIoU")
    traces = [_hooked("Model.on_validation_epoch_end", [compute], finished=False),
              _hooked("Model.on_validation_epoch_end", [])]
    run = _run(fake_runs, traces, finished=False)
    assert CONTRACT.blames(run) == Blame.CALL
    verdict = CONTRACT.judge(run)
    assert verdict.summary.startswith("BoxIoU.compute (all-gathers the metric state) called on rank 0 only "
                                      "(rank 0: 1+ calls, rank 1: 0+ calls) from Model.on_validation_epoch_end under "
                                      "`if len(self.box_iou.ious) > 0:`, a condition on rank-local state")
    assert "user_case.py:11" in verdict.summary
    details = [e.detail for e in verdict.evidence]
    assert "no BoxIoU.compute() in Model.on_validation_epoch_end (total: 0 calls)" in details
    assert any("held on rank 0 and not on rank 1" in d for d in details)
    assert verdict.fix.startswith("call compute() on every rank")
    assert "decide what to log from the synced value" in verdict.fix


def test_guards(user_file):
    assert call_guard(_site(user_file, 5, "f")) == ("if trainer.is_global_zero:", True)
    assert call_guard(_site(user_file, 6, "f")) == (None, False)
    assert call_guard(_site(user_file, 11, "f")) == ("if len(self.box_iou.ious) > 0:", False)


def test_fixes_by_kind():
    assert fix_for({"label": "strategy.reduce_boolean_decision"}).startswith(
        "call trainer.strategy.reduce_boolean_decision(decision) on every rank")
    assert fix_for({"label": "ModelCheckpoint.on_validation_end", "kind": "save"}).startswith(
        "call ModelCheckpoint.on_validation_end() on every rank, or leave it to Lightning")
    assert fix_for({"label": "Trainer.save_checkpoint", "kind": "save"}).startswith("call trainer.save_checkpoint")
    assert fix_for({"label": "BoxIoU.sync", "kind": "metric"}).startswith("call sync() on every rank")


def test_weights_only_refusal_is_a_note_on_a_passed_verdict(fake_runs):
    refusals = [{"owner": "model", "key": "loss", "refused": ["torch.nn.modules.loss.SmoothL1Loss"]},
                {"owner": "model", "key": "optimizer_cls", "refused": ["torch.optim.adam.Adam"]}]
    resume = {"phase": "resume", "files": [".metadata", "meta.pt"], "weights_only": True,
              "error": "UnpicklingError: Weights only load failed: torch.load(weights_only=True) refused "
                       "torch.nn.modules.loss.SmoothL1Loss."}
    value = {"probes": {"all-rank-save": {"sharded": resume, "weights_only": refusals}}}
    run = _run(fake_runs, [[], []], values=[value, value])
    run.strategy = "fsdp"
    verdict = CONTRACT.judge(run)
    assert verdict.outcome == "passed"
    assert "refused by torch's weights_only loading" in verdict.summary
    assert len(verdict.notes) == 1
    note = verdict.notes[0]
    assert "torch.nn.modules.loss.SmoothL1Loss, torch.optim.adam.Adam" in note
    assert "save_hyperparameters(ignore=['loss', 'optimizer_cls'])" in note and "weights_only=False" in note
    # Packages that ship their own loader (chemprop, darts) already pass weights_only=False.
    assert note.endswith("A loader of your package's own that already passes weights_only=False is not affected; "
                         "Lightning's resume and load_from_checkpoint are.")
    assert "\x1b" not in json.dumps(verdict.as_dict())
    # Without hparams data the refused class comes from the resume's own error.
    value = {"probes": {"all-rank-save": {"sharded": resume, "weights_only": []}}}
    run = _run(fake_runs, [[], []], values=[value, value])
    assert "it refuses torch.nn.modules.loss.SmoothL1Loss (" not in CONTRACT.judge(run).notes[0]
    assert "it refuses torch.nn.modules.loss.SmoothL1Loss." in CONTRACT.judge(run).notes[0]


@pytest.mark.parametrize("lightning", ["2.4.0", "2.5.6", "2.6.0", None])
def test_weights_only_note_says_what_the_lightning_that_ran_loads(fake_runs, lightning):
    """Before Lightning 2.6.0 its resume and load_from_checkpoint pass weights_only=False: they load
    the checkpoint, only the FSDP sharded resume (its metadata read with torch's default) refuses it,
    so the note must not say that one device refuses it. From 2.6.0 (and when the probe recorded no
    release: the rules' 2.6.6) every Lightning load refuses it."""
    refusals = [{"owner": "model", "key": "loss", "refused": ["torch.nn.modules.loss.SmoothL1Loss"]}]
    resume = {"phase": "resume", "files": [".metadata"], "weights_only": True,
              "error": "UnpicklingError: Weights only load failed: torch.load(weights_only=True) refused "
                       "torch.nn.modules.loss.SmoothL1Loss."}
    value = {"probes": {"all-rank-save": {"sharded": resume, "weights_only": refusals, "lightning": lightning}}}
    run = _run(fake_runs, [[], []], values=[value, value])
    run.strategy = "fsdp"
    verdict = CONTRACT.judge(run)
    assert verdict.outcome == "passed"
    note = verdict.notes[0]
    assert "it refuses torch.nn.modules.loss.SmoothL1Loss (hparams['loss'] holds" in note
    assert "Fix: save_hyperparameters(ignore=['loss'])" in note
    if lightning in ("2.4.0", "2.5.6"):
        assert f"Lightning {lightning} passes weights_only=False to its own resume" in note, note
        assert "an FSDP sharded resume does not" in note and "from Lightning 2.6.0 on neither do Lightning's" in note
        assert "on one device alike" not in note and "not a distributed fault" not in note
        assert f"which a one-device or DDP resume does not refuse on Lightning {lightning}" in verdict.summary
        assert "as it is on one device" not in verdict.summary
    else:
        assert "the default in torch 2.6+ that Lightning uses for fit/validate(ckpt_path=...)" in note
        assert "on one device alike" in note and "This is not a distributed fault." in note
        assert "as it is on one device" in verdict.summary


def test_weights_only_note_says_each_refused_class_once_and_names_the_modules_own_loader(fake_runs):
    """pytorch-tabular's hparams hold ten OmegaConf configs: the keys that hold the same classes are
    said together (the note was 2,000 characters). chemprop's MPNN overrides load_from_checkpoint."""
    listy = ["omegaconf.listconfig.ListConfig", "omegaconf.base.ContainerMetadata", "typing.Any", "list"]
    refusals = [{"owner": "model", "key": k, "refused": listy} for k in ("target", "continuous_cols", "metrics")]
    refusals.append({"owner": "model", "key": "head_config", "refused": ["omegaconf.dictconfig.DictConfig", "dict"]})
    value = {"probes": {"all-rank-save": {"weights_only": refusals, "own_loader": "MPNN"}}}
    note = CONTRACT.judge(_run(fake_runs, [[], []], values=[value, value])).notes[0]
    assert ("(hparams['target'], hparams['continuous_cols'], hparams['metrics'] hold omegaconf.listconfig.ListConfig, "
            "omegaconf.base.ContainerMetadata, typing.Any, list; hparams['head_config'] holds "
            "omegaconf.dictconfig.DictConfig, dict)") in note, note
    assert note.count("omegaconf.base.ContainerMetadata") == 2, note  # the refused list, then one group
    assert note.endswith("Lightning's resume is; MPNN.load_from_checkpoint is the module's own, so whether a load "
                         "through it is depends on what it passes to torch.load."), note


def test_own_loader_is_a_class_that_overrides_lightnings():
    import lightning.pytorch as L

    from pytest_ltconform.contracts.all_rank_save.probe import own_loader

    class Plain(L.LightningModule):
        pass

    class Loads(L.LightningModule):
        @classmethod
        def load_from_checkpoint(cls, path, **kwargs):
            return super().load_from_checkpoint(path, weights_only=False, **kwargs)

    class Sub(Loads):
        pass

    assert own_loader(Plain) is None
    assert own_loader(Sub) == own_loader(Loads) == "Loads"


def test_refused_globals_finds_every_class():
    import torch

    obj = {"loss": torch.nn.SmoothL1Loss(beta=0.5), "opt": torch.optim.Adam, "lr": 0.1}
    assert probe.refused_globals(obj) == ["torch.nn.modules.loss.SmoothL1Loss", "torch.optim.adam.Adam"]
    assert probe.refused_globals({"lr": 0.1, "name": "adam"}) == []


def test_exc_text_strips_ansi_and_keeps_whole_sentences():
    exc = pickle.UnpicklingError("Weights only load failed. \x1b[1mdo those steps\x1b[0m. Unsupported global: "
                                 "GLOBAL torch.nn.modules.loss.SmoothL1Loss was not an allowed global")
    text = probe.exc_text(exc)
    assert "\x1b" not in text
    assert text == ("UnpicklingError: Weights only load failed: torch.load(weights_only=True) refused "
                    "torch.nn.modules.loss.SmoothL1Loss.")
    long = probe.exc_text(ValueError("First sentence. " + "word " * 100), limit=60)
    assert long == "ValueError: First sentence."


def test_exc_text_of_a_distributed_checkpoint_failure_names_the_ranks_own_exception():
    # Its str() is every rank's traceback: cut at 300 characters it ended in a file path (a
    # pytorch-tabular trial); the cause is the rank's own exception.
    from torch.distributed.checkpoint.api import CheckpointException

    cause = ValueError("Size mismatch between saved torch.Size([16, 5]) and current: torch.Size([80]) for "
                       "model.weight")
    exc = CheckpointException("failed", {0: (cause, None), 1: (cause, None)})
    assert probe.exc_text(exc) == f"CheckpointException on rank(s) 0, 1: ValueError: {cause}"


# -- rank-side taps ------------------------------------------------------------------------------

def _events(recorder):
    recorder.uninstall()
    with open(recorder.path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def _library_caller():
    """A function whose frame looks like Lightning's (file and module name)."""
    import lightning.pytorch as lp

    namespace = {"__name__": "lightning.pytorch.strategies.fake"}
    exec(compile("def call(fn, *args):\n    return fn(*args)\n", lp.__file__, "exec"), namespace)
    return namespace["call"]


class _FakeDDP:
    def _check_sync_bufs_pre_fwd(self):
        return True


def test_ddp_forward_traced_only_when_user_code_calls_the_wrapper(tmp_path):
    recorder = Recorder(str(tmp_path / "trace.jsonl"), 0)
    forward = taps.ddp_forward_tap(recorder)(lambda ddp, x: x + 1)
    assert forward(_FakeDDP(), 1) == 2                  # user code calls the wrapper
    assert _library_caller()(forward, _FakeDDP(), 1) == 2  # Lightning's own step
    calls = [e for e in _events(recorder) if e["ev"] == "call"]
    assert len(calls) == 1
    call = calls[0]
    assert (call["label"], call["op"], call["effect"], call["user"]) == (
        "DistributedDataParallel.forward", "ddp_forward", "broadcasts buffers", True)
    assert call["site"]["file"] == __file__ and call["parent"] is None
    assert list(call)[:8] == ["ev", "kind", "op", "label", "site", "user", "parent", "hook"]


def test_checkpoint_tap_traces_direct_user_calls(tmp_path):
    recorder = Recorder(str(tmp_path / "trace.jsonl"), 0)
    ModelCheckpoint = type("ModelCheckpoint", (), {})
    method = taps.checkpoint_tap(recorder, "on_validation_end")(lambda cb, trainer, module: "saved")
    assert method(ModelCheckpoint(), None, None) == "saved"
    _library_caller()(method, ModelCheckpoint(), None, None)
    calls = [e for e in _events(recorder) if e["ev"] == "call"]
    assert [(c["label"], c["user"]) for c in calls] == [("ModelCheckpoint.on_validation_end", True)]


def test_metric_compute_without_a_distributed_group_is_not_traced(tmp_path):
    from torchmetrics import MeanMetric

    recorder = Recorder(str(tmp_path / "trace.jsonl"), 0)
    import torchmetrics

    recorder.patch(torchmetrics.Metric, "_sync_dist", taps.metric_sync_tap(recorder))
    metric = MeanMetric()
    metric.update(1.0)
    assert float(metric.compute()) == 1.0
    assert not [e for e in _events(recorder) if e["ev"] == "call"]


def test_recorder_call_nests_library_collectives(tmp_path):
    recorder = Recorder(str(tmp_path / "trace.jsonl"), 0)
    inner = recorder._call_wrapper("collective", "all_gather", "torch.distributed.all_gather")(lambda: None)
    with recorder.call("metric", "metric_sync", "BoxIoU.compute", {"file": "x.py", "line": 3, "func": "f"}, True):
        inner()
    events = _events(recorder)
    outer, nested = [e for e in events if e["ev"] == "call"]
    assert outer["user"] is True and nested["parent"] == outer["seq"] and nested["user"] is False
    assert [e["of"] for e in events if e["ev"] == "exit"] == [nested["seq"], outer["seq"]]


def test_a_rank_that_raised_on_its_own_is_not_a_one_sided_call(fake_runs, user_file):
    """Rank 0 raised in its own code before the barrier: rank 1's barrier is a consequence."""
    traces = [_hooked("Preview.on_train_epoch_end", []) +
              [{"ev": "hook", "i": 2, "name": "[Callback]Preview.on_exception", "h": 2}],
              _hooked("Preview.on_train_epoch_end", [_barrier(user_file, seq=2)], finished=False)]
    ranks = [fake_runs.rank(0, traces[0], status="error", exc_type="RuntimeError",
                            message="mat2 must be a matrix, got 1-D tensor"),
             fake_runs.rank(1, traces[1], status="hung")]
    run = fake_runs.of(ranks, status="error", divergence=first_divergence(traces))
    assert run.divergent_events() == {"call"}
    assert CONTRACT.blames(run) is None
    assert CONTRACT.judge(run).outcome == "passed"
    # A peer's connection error is not "on its own": the barrier stays the finding.
    ranks[0] = fake_runs.rank(0, traces[0], status="error", exc_type="RuntimeError",
                              message="[gloo] Connection closed by peer")
    run = fake_runs.of(ranks, status="error", divergence=first_divergence(traces))
    assert CONTRACT.blames(run) == Blame.CALL


@pytest.mark.slow
def test_all_gather_under_a_rank_guard_in_the_test_stage_fails(pytester, no_leftover_ranks):
    from conftest import case

    path = case("all-rank-save/all_gather_rank_zero_guard_test_epoch_end.py")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ltconform", path,
                                           "--ltconform-nodes", "1", "-k", "all-rank-save[ and ddp", "-v")
    out = result.stdout.str()
    result.assert_outcomes(failed=1)
    assert "LightningModule.all_gather called on rank 0 only" in out and "Model.on_test_epoch_end" in out
    assert "all_gather_rank_zero_guard_test_epoch_end.py:40" in out


# -- a collective a rank leaves its peers waiting in -------------------------------------------------

_STEP = '''
class Model:
    def training_step(self, batch, batch_idx):
        x, y = batch
        if bad(y):
            return None
        loss = f(x, y)
        self.manual_backward(loss)
'''


def test_the_rank_that_left_the_step_without_its_backward_is_the_cause(fake_runs, tmp_path):
    """Manual optimization: rank 1 returned before manual_backward, rank 0 waited in the gradient
    all-reduce. The rank whose collective sequence is short is blamed, with its return line."""
    from pytest_ltconform.contracts.base import Run

    path = tmp_path / "manual.py"
    path.write_text(_STEP)

    def hooks(*names):
        return [{"ev": "hook", "i": i + 1, "name": n, "h": i + 1, "epoch": 0, "step": 3}
                for i, n in enumerate(names)]

    start = ["[LightningModule]Model.on_train_batch_start", "[Strategy]DDPStrategy.training_step"]
    rank0 = hooks(*start, "[LightningModule]Model.on_before_backward")
    rank1 = hooks(*start, "[Callback]on_train_batch_end")
    div = first_divergence([rank0, rank1])
    assert div["kind"] == "hooks"
    run = fake_runs.of([fake_runs.rank(0, rank0, status="hung"), fake_runs.rank(1, rank1, status="hung")],
                       status="hung", divergence=div)
    run.target = type("T", (), {"model_classes": (("Model", str(path)),)})()
    assert isinstance(run, Run) and CONTRACT.blames(run) == Blame.CALL
    verdict = CONTRACT.judge(run)
    assert verdict.outcome == "failed" and verdict.category == "deadlock", verdict.render()
    assert verdict.summary.startswith("rank 1 left training_step without the backward that rank 0 ran in the same "
                                      "step (epoch 0, training step 0)")
    assert f"rank 1 returned at {path}:6 (Model.training_step)" in verdict.summary
    text = verdict.render()
    assert "rank 1 at" in text and "training_step returns under `if bad(y):` before the backward at line 8" in text


def test_a_pass_names_the_collectives_library_calls_made_for_user_code(fake_runs):
    """The log_dir twin: every rank read trainer.log_dir (a property that broadcasts) at the same
    line; the pass says so, not "user code makes no collective-bearing call"."""
    site = _site("/x/cb.py", 12, "SamplePlots.on_train_epoch_end")
    via = {"file": "/site/lightning/pytorch/trainer/trainer.py", "line": 1331, "func": "Trainer.log_dir",
           "property": True}
    call = {"ev": "call", "kind": "strategy", "op": "broadcast", "label": "strategy.broadcast", "site": site,
            "user": False, "parent": None, "via": via, "seq": 2, "h": 1}
    run = fake_runs.run([[dict(call)], [dict(call)]])
    verdict = CONTRACT.judge(run)
    assert verdict.outcome == "passed"
    assert verdict.summary.startswith("every rank made the same collective-bearing calls from user code, in the same "
                                      "order (Trainer.log_dir (its strategy.broadcast) at /x/cb.py:12")
    other = dict(call, site=_site("/x/cb.py", 13, "SamplePlots.on_train_epoch_end"))
    assert CONTRACT.judge(fake_runs.run([[dict(call)], [other]])).summary.startswith("user code makes no")


def test_the_fix_for_a_property_reads_it_instead_of_calling_it(tmp_path):
    from pytest_ltconform.contracts.all_rank_save import call_words

    user = tmp_path / "cb.py"
    user.write_text("def hook(trainer):\n    out = os.path.join(trainer.log_dir, 'x')\n")
    via = {"file": "/nowhere/trainer.py", "line": 1, "func": "log_dir", "property": True}
    assert call_words(via, site={"file": str(user), "line": 2}) == "read trainer.log_dir"
    assert call_words({"func": "save_checkpoint", "property": False}) == "call save_checkpoint()"


def _save_raised(user_saves):
    """The CPU FSDP round trip whose sharded save raised (lightly's LinearClassifier: the optimizer
    holds only the head's parameters), as the probe records it."""
    sharded = {"phase": "save", "error": "RuntimeError: model.0.weight is not in the optimizer state.",
               "weights_only": False, "frame": {"file": "/site/torch/distributed/fsdp/_optim_utils.py", "line": 1581,
                                                "func": "_get_fqn_to_param"}}
    return {"probes": {"all-rank-save": {"sharded": sharded, "weights_only": [], "user_saves": user_saves}}}


def _fsdp_run(fake_runs, user_saves, configured=False):
    """An FSDP run of the round trip above; ``configured``: the user's config names FSDP."""
    trace = [{"ev": "strategy", "configured": configured}]
    run = fake_runs.run([list(trace), list(trace)], values=[_save_raised(user_saves)] * 2)
    run.strategy = "fsdp"
    return run


def test_a_sharded_save_that_raised_is_said_as_such_and_judged_by_what_the_config_saves(fake_runs):
    """Field trial (lightly): "every rank saved a sharded checkpoint directory (nothing), but resuming
    from it does not work" where the save itself raised. The save's failure is named with its frame,
    resume not tried; a config that saves full state dicts is not judged (the plugin chose sharded),
    one that saves sharded fails."""
    for saves, configured in (("file", False), ("deepspeed", False), ("file", True)):
        verdict = CONTRACT.judge(_fsdp_run(fake_runs, saves, configured))
        # Not judged; skipped where the config names no sharded strategy (the tier does not apply).
        assert verdict.outcome is (Outcome.NOT_JUDGED if configured else Outcome.SKIPPED), verdict.summary
        assert verdict.summary.startswith(("not judged: " if configured else "") + "the plugin's FSDP run saved "
                                          "with state_dict_type='sharded' where your config saves ")
        assert ("that sharded save raised on rank 0: RuntimeError: model.0.weight is not in the optimizer state. "
                "(raised at /site/torch/distributed/fsdp/_optim_utils.py:1581 (_get_fqn_to_param)); no directory was "
                "saved and resuming from one was not tried") in verdict.summary
        assert "(nothing)" not in verdict.summary and "saved a sharded checkpoint directory" not in verdict.summary
        assert any(n.startswith("advisory: trainer.save_checkpoint breaks") for n in verdict.notes)
    verdict = CONTRACT.judge(_fsdp_run(fake_runs, "fsdp", configured=True))
    assert verdict.outcome is Outcome.FAILED
    assert "raised on 2 ranks, so no checkpoint directory was saved and resuming from one was not tried" in \
        verdict.summary
    assert "_optim_utils.py:1581" in verdict.evidence[0].detail


def test_a_pass_counts_member_metric_syncs_as_such(fake_runs):
    """Field trial (torch-uncertainty): "MetricCollection.compute x44" counted the syncs of the
    collection's member metrics (4 calls x 11 members): the sentence names what it counts."""
    site = _site("/x/m.py", 20, "Model.on_validation_epoch_end")
    events = [_call("MetricCollection.compute", site, seq=2 + i, kind="metric", op="metric_sync", metric=m)
              for i, m in enumerate(["BinaryAccuracy", "BinaryAUROC"] * 3)]
    events.append(_call("Entropy.compute", site, seq=9, kind="metric", op="metric_sync", metric="Entropy"))
    verdict = CONTRACT.judge(fake_runs.run([events, [dict(e) for e in events]]))
    assert verdict.outcome is Outcome.PASSED
    assert "Entropy.compute x1" in verdict.summary
    assert "MetricCollection.compute (6 syncs of its member metrics BinaryAUROC, BinaryAccuracy)" in verdict.summary
    assert "MetricCollection.compute x6" not in verdict.summary


# -- a library wrapper is named by the method the user called -----------

_WRAP = ("import functools\n"
         "def wrap(self, compute, where):\n"
         "    @functools.wraps(compute)\n"
         "    def wrapped_func():\n"
         "        assert self is not None\n"
         "        return where(1)\n"
         "    return wrapped_func\n")


class MeanSquaredError:
    def compute(self):
        return None


def test_library_call_names_the_metric_method_not_its_wrapper():
    """TorchMetrics stores ``wrapped_func`` on the metric in place of ``compute``: the call the user
    made is ``MeanSquaredError.compute``, not the wrapper's own name."""
    import torchmetrics

    from pytest_ltconform.sites import library_call

    namespace = {"__name__": "torchmetrics.metric"}
    exec(compile(_WRAP, torchmetrics.__file__, "exec"), namespace)
    metric = MeanSquaredError()
    metric.compute = namespace["wrap"](metric, metric.compute, library_call)
    via = metric.compute()
    assert (via["func"], via["property"]) == ("MeanSquaredError.compute", False)


def test_a_mismatch_inside_a_metric_compute_names_it_and_sync_on_compute(fake_runs, tmp_path):
    import torchmetrics.metric

    path = tmp_path / "m.py"
    path.write_text("class Model:\n    @rank_zero_only\n    def on_validation_epoch_end(self):\n"
                    "        v = float(self.val_mse.compute())\n")
    site = {"file": str(path), "line": 4, "func": "Model.on_validation_epoch_end"}
    via = {"file": torchmetrics.metric.__file__, "line": 694, "func": "wrapped_func"}  # Flight Recorder's frame
    traced = {"ev": "call", "kind": "metric", "op": "metric_sync", "label": "MeanSquaredError.compute", "site": site,
              "user": True, "parent": None}
    ranks = [fake_runs.rank(r, [traced] if r == 0 else [], status="error", exc_type="RuntimeError", message="stack")
             for r in range(2)]
    run = fake_runs.of(ranks, status="error")
    run.job.mismatch = {"pg": "0", "seq": 5, "broke_at": 5, "calls": {0: {"op": "allgather", "site": site, "via": via}}}
    verdict = CONTRACT._mismatched(run)
    assert verdict.summary.startswith("MeanSquaredError.compute (metric.py:694; its allgather was this collective) "
                                      "called on rank 0"), verdict.render()
    assert verdict.fix.startswith("call MeanSquaredError.compute() on every rank, in the same order")
    assert "wrapped_func" not in verdict.render()
    assert "sync_on_compute=False (a constructor argument) makes compute() skip this collective" in verdict.fix
