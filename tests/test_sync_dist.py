"""sync-dist: verdicts on hand-made runs (values derived from per-batch metrics, decisions that
differ, checkpoint filenames, Lightning's batch-size inference) and the rank-side helpers."""

from __future__ import annotations

import pytest

from pytest_ltconform import claims
from pytest_ltconform.contracts import get_contract
from pytest_ltconform.contracts.base import Blame
from pytest_ltconform.contracts.sync_dist import decisions
from pytest_ltconform.contracts.sync_dist.batches import count_samples
from pytest_ltconform.contracts.sync_dist.combos import find_combinations

SITE = {"file": "/user/model.py", "line": 42, "func": "Model.validation_step"}
RUN = ["validate", 1, False, 2]


def _final(metrics=None, **over):
    final = {"callback_metrics": metrics or {}, "should_stop": False, "current_epoch": 2, "global_step": 8,
             "checkpoints": [], "early_stopping": [], "monitors": []}
    final.update(over)
    return final


def _value(final, **probe):
    return {"probes": {"sync-dist": {"final": final, "snapshots": probe.pop("snapshots", []), **probe}}}


# -- 1. values derived from per-batch functional metrics --------------------------------------------

def test_find_combinations_smallest_first():
    assert find_combinations(0.5, [0.5, 0.25]) == [("single", (0,))]
    assert find_combinations(0.75, [0.5, 0.25, 0.9]) == [("sum", (0, 1))]
    assert find_combinations(0.375, [0.5, 0.25, 0.9]) == [("mean", (0, 1))]
    assert find_combinations(3.0, [0.5, 0.25]) == []
    # an AUROC and an accuracy both 1.0 on one batch: their mean is kept next to each part alone
    assert find_combinations(1.0, [1.0, 1.0]) == [("single", (0,)), ("single", (1,)), ("mean", (0, 1))]


def test_common_signature_is_the_one_every_batch_shares():
    from pytest_ltconform.contracts.sync_dist.nonlinear import common_signature

    both = {"single|auroc#0": {}, "single|accuracy#0": {}, "mean|auroc#0,accuracy#0": {}}
    records = [{"batches": [{"combos": both}, {"combos": {"mean|auroc#0,accuracy#0": {}}}]}]
    assert common_signature(records) == "mean|auroc#0,accuracy#0"
    records[0]["batches"].append({"combos": {"single|auroc#0": {}}})
    assert common_signature(records) is None


def _part(key, fn, label, args, value):
    return {"key": key, "label": label, "kind": "functional", "name": fn.rsplit(".", 1)[-1], "fn": fn,
            "args": args, "kwargs": {"task": "binary"} if "auroc" in fn or "accuracy" in fn else {}, "value": value}


def _records(parts_of, batches_per_rank, mode="sum"):
    """Per-rank per_batch records of a key logged as the ``mode`` of ``parts_of(preds, target)``."""
    records = []
    for batches in batches_per_rank:
        rows = []
        for preds, target in batches:
            parts = parts_of(preds, target)
            sig = f"{mode}|" + ",".join(p["key"] for p in parts)
            total = sum(p["value"] for p in parts)
            rows.append({"logged": total / len(parts) if mode == "mean" else total,
                         "combos": {sig: {"mode": mode, "parts": parts}}})
        records.append({"run": RUN, "hook": "validation_step", "site": SITE, "via": "log", "sync_dist": True,
                        "batches": rows, "templates": {}})
    return records


def _blocks():
    """Two ranks, two batches each: every batch separable, the pooled ranking is not."""
    import torch

    def batch(offset):
        target = torch.tensor([0, 1, 0, 1])
        return torch.tensor([0.1, 0.3, 0.2, 0.4]) + offset, target

    return [[batch(0.0), batch(0.5)], [batch(0.25), batch(0.1)]]


def _auroc_acc(preds, target):
    from torchmetrics.functional import accuracy, auroc

    return [_part("auroc#0", "torchmetrics.functional.classification.auroc.auroc", "functional auroc",
                  [preds, target], float(auroc(preds, target, task="binary"))),
            _part("accuracy#0", "torchmetrics.functional.classification.accuracy.accuracy", "functional accuracy",
                  [preds, target], float(accuracy(preds, target, task="binary")))]


def _acc_mse(preds, target):
    from torchmetrics.functional import accuracy, mean_squared_error

    return [_part("accuracy#0", "torchmetrics.functional.classification.accuracy.accuracy", "functional accuracy",
                  [preds, target], float(accuracy(preds, target, task="binary"))),
            _part("mean_squared_error#0", "torchmetrics.functional.regression.mse.mean_squared_error",
                  "functional mean_squared_error", [preds, target.float()],
                  float(mean_squared_error(preds, target.float())))]


def _epoch_value(records):
    rows = [b for r in records for b in r["batches"]]
    return sum(b["logged"] for b in rows) / len(rows)  # equal batch sizes: Lightning's weighted mean


def test_sum_of_per_batch_auroc_and_accuracy_fails_naming_auroc(fake_runs):
    import torch
    from torchmetrics.functional import accuracy, auroc

    records = _records(_auroc_acc, _blocks())
    logged = _epoch_value(records)
    preds = torch.cat([p for rank in _blocks() for p, _ in rank])
    target = torch.cat([t for rank in _blocks() for _, t in rank])
    truth = float(auroc(preds, target, task="binary")) + float(accuracy(preds, target, task="binary"))
    values = [_value(_final({"val_score": logged}), per_batch={"val_score": r}) for r in records]
    verdict = get_contract("sync-dist").judge(fake_runs.run(values=values))
    assert verdict.outcome == "failed" and verdict.category == "silent"
    assert "is the sum of functional auroc and functional accuracy of each batch" in verdict.summary
    assert "functional auroc is nonlinear" in verdict.summary
    assert f"logged epoch value {logged:.4f}" in verdict.summary and f"({truth:.4f})" in verdict.summary
    assert "over the epoch's 16 samples" in verdict.summary
    details = [e.detail for e in verdict.evidence]
    assert any(d.startswith("functional auroc: mean of its per-batch values 1.0000") for d in details)
    assert any("functional accuracy" in d and "(linear: the same either way)" in d for d in details)
    assert "AUROC" in verdict.fix


def test_sum_of_linear_per_batch_metrics_passes(fake_runs):
    records = _records(_acc_mse, _blocks())
    values = [_value(_final({"val_score": _epoch_value(records)}), per_batch={"val_score": r}) for r in records]
    verdict = get_contract("sync-dist").judge(fake_runs.run(values=values))
    assert verdict.outcome == "passed", verdict.render()


def test_mean_of_per_batch_auroc_and_accuracy_fails(fake_runs):
    records = _records(_auroc_acc, _blocks(), mode="mean")
    values = [_value(_final({"val_q": _epoch_value(records)}), per_batch={"val_q": r}) for r in records]
    verdict = get_contract("sync-dist").judge(fake_runs.run(values=values))
    assert verdict.outcome == "failed"
    assert "is the mean of functional auroc and functional accuracy" in verdict.summary


def test_an_unsynced_per_batch_metric_is_called_rank_zeros_own_not_reduced_over_ranks(fake_runs):
    """Issue 32: "mean-reduced over batches and ranks" was said of a value logged without sync_dist.
    Lightning averages it over each rank's own batches and publishes rank 0's: the nonlinear part is
    measured against rank 0's own samples, and the rank-local part is told apart."""
    import torch
    from torchmetrics.functional import accuracy, auroc

    records = _records(_auroc_acc, _blocks())
    for r in records:
        r["sync_dist"] = False
    logged = _epoch_value(records[:1])  # rank 0's own batches only
    values = [_value(_final({"val_score": logged}), per_batch={"val_score": r}) for r in records]
    verdict = get_contract("sync-dist").judge(fake_runs.run(values=values))
    assert verdict.outcome == "failed", verdict.render()
    assert "mean-reduced over batches and ranks" not in verdict.summary
    assert ("not synced (no sync_dist), so Lightning averages its per-batch values over each rank's own batches and "
            "publishes rank 0's") in verdict.summary
    preds, target = (torch.cat([b[i] for b in _blocks()[0]]) for i in (0, 1))
    own = float(auroc(preds, target, task="binary")) + float(accuracy(preds, target, task="binary"))
    assert f"rank 0's logged epoch value {logged:.4f} is not the sum of the same metrics over rank 0's 8 samples of " \
           f"the epoch ({own:.4f})" in verdict.summary, verdict.summary
    assert "samples of all ranks it is" in verdict.summary and "rank 0's shard alone" in verdict.summary
    record = {"contract": "sync-dist", **verdict.as_dict()}
    assert claims.check(record) == []
    # Today's words over the same run: a reduction claimed with no recorded sync.
    record["message"] += "\n'val_score' is mean-reduced over batches and ranks."
    assert any("no reduced claim" in p for p in claims.check(record))


def test_probe_records_a_value_computed_from_tapped_outputs():
    import torch
    import torchmetrics

    from pytest_ltconform.contracts.sync_dist.probe import SyncDistProbe

    class Recorder:
        trainer = None
        recording = True  # not inside Recorder.paused()

        def current_hook(self):
            return "validation_step"

    probe = SyncDistProbe()
    probe.recorder = Recorder()
    preds, target = torch.tensor([0.2, 0.7, 0.4, 0.9]), torch.tensor([0, 1, 1, 1])
    auroc = probe._functional(torchmetrics.functional.auroc, "torchmetrics.functional.auroc")(preds, target,
                                                                                               task="binary")
    acc = probe._functional(torchmetrics.functional.accuracy, "torchmetrics.functional.accuracy")(preds, target,
                                                                                                  task="binary")
    value = torch.stack([auroc, acc]).sum()
    event = {"name": "val_score", "hook": "validation_step", "site": SITE, "via": "log", "sync_dist": True,
             "on_epoch": True, "reduce_fx": "mean", "vtype": "tensor", "batch_size": True, "value": float(value)}
    probe._on_log(event, value)
    record = probe.per_batch["val_score"]
    assert list(record["batches"][0]["combos"]) == ["sum|auroc#0,accuracy#0"]
    parts = record["batches"][0]["combos"]["sum|auroc#0,accuracy#0"]["parts"]
    assert [p["label"] for p in parts] == ["functional auroc", "functional accuracy"]
    assert parts[0]["value"] == pytest.approx(float(auroc))


# -- 2. checkpoint filename interpolating an unsynced metric ----------------------------------------

def test_filename_metrics_parsed():
    assert decisions.filename_metrics("{epoch}-{val_acc:.3f}") == ["val_acc"]
    assert decisions.filename_metrics("best-{step}-{val/loss:.2f}-{val_f1}") == ["val/loss", "val_f1"]
    assert decisions.filename_metrics(None) == []


def test_checkpoint_paths_differ_by_unsynced_filename_metric(fake_runs):
    ckpt = lambda path: {"monitor": "val_loss", "best_model_path": path, "best_model_score": 0.74,  # noqa: E731
                         "best_k": [path], "filename": "{epoch}-{val_acc:.3f}"}
    snaps = lambda acc: [{"event": "validation_end", "epoch": 0, "step": 4, "metrics": {"val_acc": acc},  # noqa: E731
                          "should_stop": False}]
    values = [_value(_final(checkpoints=[ckpt("epoch=0-val_acc=0.875.ckpt")]), snapshots=snaps(0.875)),
              _value(_final(checkpoints=[ckpt("epoch=0-val_acc=0.250.ckpt")]), snapshots=snaps(0.25))]
    log = {"ev": "log", "name": "val_acc", "hook": "validation_step", "site": SITE, "sync_dist": False,
           "vtype": "tensor"}
    verdict = get_contract("sync-dist").judge(fake_runs.run(traces=[[log], [log]], values=values))
    assert verdict.outcome == "failed"
    assert "although the monitored 'val_loss' agrees" in verdict.summary
    assert "interpolates 'val_acc', logged without sync_dist in validation_step at /user/model.py:42" in \
        verdict.summary
    assert verdict.fix.startswith("at /user/model.py:42 (Model.validation_step), log 'val_acc' on every rank with "
                                  "sync_dist=True")
    assert any("rank 0 0.875 vs rank 1 0.25" in e.detail for e in verdict.evidence)


def test_checkpoint_paths_differ_by_a_filename_made_per_rank(fake_runs):
    """Same best score on every rank, no metric in the filename: the filename itself was made per rank
    (pytorch-tabular names it after a run counter each rank bumps). Not a metric disagreement."""
    ckpt = lambda name: {"monitor": "valid_loss", "best_model_path": f"{name}_epoch=3-valid_loss=4.83.ckpt",  # noqa: E731
                         "best_model_score": 4.8323, "best_k": [], "filename": name + "_{epoch}-{valid_loss:.2f}",
                         "site": SITE}
    values = [_value(_final(checkpoints=[ckpt("regression-3")])), _value(_final(checkpoints=[ckpt("regression-5")]))]
    verdict = get_contract("sync-dist").judge(fake_runs.run(traces=[[], []], values=values))
    assert verdict.outcome == "failed", verdict.render()
    expected = ("ModelCheckpoint(monitor='valid_loss') ends with a different best_model_path on each rank although "
                "the best score is the same on every rank (4.8323): its filename is not the same on every rank "
                "(rank 0 'regression-3_{epoch}-{valid_loss:.2f}', rank 1 'regression-5_{epoch}-{valid_loss:.2f}')")
    assert verdict.summary.startswith(expected), verdict.summary
    assert "disagree about which checkpoint is best" not in verdict.summary
    assert any(e.detail == "ModelCheckpoint filename 'regression-5_{epoch}-{valid_loss:.2f}', built at "
               "/user/model.py:42 (Model.validation_step)" and e.rank == 1 for e in verdict.evidence), verdict.render()
    assert verdict.fix.startswith("give ModelCheckpoint the same filename on every rank")
    assert "sync_dist" not in verdict.fix
    # A different best score is still the metric disagreement.
    values[1]["probes"]["sync-dist"]["final"]["checkpoints"][0]["best_model_score"] = 5.1
    other = get_contract("sync-dist").judge(fake_runs.run(traces=[[], []], values=values))
    assert other.summary.startswith("ModelCheckpoint(monitor='valid_loss') ends with a different best_model_score on "
                                    "each rank and a different best_model_path: "), other.summary
    assert claims.check({"contract": "sync-dist", **other.as_dict()}) == []


def _best(path, score, monitor="val_loss"):
    return {"monitor": monitor, "best_model_path": path, "best_model_score": score, "best_k": [path],
            "filename": None}


def test_same_best_path_with_different_scores_says_the_scores_differ_not_the_checkpoint(fake_runs):
    """Issue 32: 'a different best checkpoint on each rank' under evidence of one best_model_path on
    every rank. What differs is the score, and with it the ranking each rank's top k is decided on."""
    es = [{"monitor": "val_loss", "stopped_epoch": 0, "wait_count": 0}]
    values = [_value(_final(checkpoints=[_best("epoch=1-step=8.ckpt", 0.2599)], early_stopping=es)),
              _value(_final(checkpoints=[_best("epoch=1-step=8.ckpt", 0.2411)], early_stopping=es))]
    verdict = get_contract("sync-dist").judge(fake_runs.run(traces=[[], []], values=values))
    assert verdict.outcome == "failed" and verdict.category == "silent"
    assert verdict.summary.startswith(
        "ModelCheckpoint(monitor='val_loss') ends with a different best_model_score on each rank, with the same "
        "best_model_path on every rank ('epoch=1-step=8.ckpt'): "), verdict.summary
    assert "top-k checkpoints" in verdict.summary and "EarlyStopping(monitor='val_loss') decides" in verdict.summary
    assert "different best checkpoint" not in verdict.summary
    assert claims.check({"contract": "sync-dist", **verdict.as_dict()}) == []
    # The sentence before the fix, with the same evidence, fails the consistency check.
    old = verdict.as_dict()
    old["message"] = old["message"].replace(verdict.summary, "ModelCheckpoint(monitor='val_loss') ends with a "
                                            "different best checkpoint on each rank: the ranks disagree.")
    old["claims"] = [claims.claim("differ", "different best checkpoint on each rank",
                                  values={"rank 0": "epoch=1-step=8.ckpt", "rank 1": "epoch=1-step=8.ckpt"}).as_dict()]
    assert any("the recorded values are the same" in p for p in claims.check({"contract": "sync-dist", **old}))


# -- 2. monitored values where their callbacks read them --------------------------------------------

def _read(value, epoch, owner="EarlyStopping", hook="on_train_epoch_end", key="train_loss"):
    return {"owner": owner, "cls": owner, "n": 0, "key": key, "hook": hook, "epoch": epoch, "step": 4 * (epoch + 1),
            "sanity": False, "value": value}


def _monitored_run(fake_runs, reads0, reads1, log_flags=None, key="train_loss"):
    log = {"ev": "log", "name": key, "hook": "training_step", "site": SITE, "sync_dist": False, "vtype": "tensor",
           "on_epoch": True, **(log_flags or {})}
    monitors = [{"key": key, "owner": "EarlyStopping"}]
    values = [_value(_final(monitors=monitors), reads=reads0), _value(_final(monitors=monitors), reads=reads1)]
    return fake_runs.run(traces=[[log], [log]], values=values)


def test_a_monitor_read_at_train_epoch_end_is_compared_there(fake_runs):
    """EarlyStopping(check_on_train_epoch_end=True) on an unsynced train metric: no validation ever
    runs, and the values differ where the callback reads them (missed before: only the snapshots
    after validation were compared)."""
    run = _monitored_run(fake_runs, [_read(0.5, 0), _read(0.4, 1)], [_read(0.7, 0), _read(0.6, 1)])
    verdict = get_contract("sync-dist").judge(run)
    assert verdict.outcome == "failed", verdict.render()
    assert "its value differs across ranks (read by EarlyStopping in on_train_epoch_end at epoch 0)" in verdict.summary
    assert any("'train_loss' read by EarlyStopping in on_train_epoch_end at epoch 1: rank 0 0.4 vs rank 1 0.6"
               == e.detail for e in verdict.evidence), verdict.render()
    assert claims.check({"contract": "sync-dist", **verdict.as_dict()}) == []


def test_a_passing_monitor_names_the_reads_it_compared_and_none_compared_is_not_judged(fake_runs):
    synced = {"sync_dist": True}
    run = _monitored_run(fake_runs, [_read(0.5, 0), _read(0.4, 1)], [_read(0.5, 0), _read(0.4, 1)], synced)
    verdict = get_contract("sync-dist").judge(run)
    assert verdict.outcome == "passed", verdict.render()
    assert ("monitored 'train_loss' equal on every rank at each of the 2 value(s) compared (read by EarlyStopping "
            "in on_train_epoch_end, epochs 0-1)") in verdict.summary
    assert claims.check({"contract": "sync-dist", **verdict.as_dict()}) == []
    # No read on any rank (the callback never checked): nothing was compared, so no pass.
    run = _monitored_run(fake_runs, [], [], {"sync_dist": False})
    verdict = get_contract("sync-dist").judge(run)
    assert verdict.outcome == "not_judged", verdict.render()
    assert "monitored 'train_loss' not judged: no callback read it in this run" in verdict.summary


def test_a_rank_zero_only_monitor_is_not_said_to_differ_unless_measured(fake_runs):
    run = _monitored_run(fake_runs, [_read(0.5, 0)], [_read(0.5, 0)], {"rank_zero_only": True})
    verdict = get_contract("sync-dist").judge(run)
    assert verdict.outcome == "failed"
    assert "differs" not in verdict.summary and "decides on its own shard's value" in verdict.summary
    assert claims.check({"contract": "sync-dist", **verdict.as_dict()}) == []


# -- 3. decisions that differ, where they first differ ----------------------------------------------

def _stop(step, rank_site=SITE):
    return {"ev": "decision", "name": "should_stop", "value": True, "site": rank_site, "user": True,
            "hook": "on_train_batch_end", "epoch": 0, "step": step}


def test_should_stop_on_one_rank_fails_at_the_step_and_claims_the_hang(fake_runs):
    rank0 = [{"ev": "hook", "i": 1, "name": "[LightningModule]Model.training_step", "epoch": 0, "step": 2},
             _stop(3)]
    rank1 = [{"ev": "hook", "i": 1, "name": "[LightningModule]Model.training_step", "epoch": 0, "step": 3}]
    run = fake_runs.of([fake_runs.rank(0, rank0, status="hung"), fake_runs.rank(1, rank1, status="hung")],
                       status="hung")
    contract = get_contract("sync-dist")
    assert contract.blames(run) == Blame.DECISION
    verdict = contract.judge(run)
    assert verdict.outcome == "failed" and verdict.category == "deadlock"
    assert verdict.summary.startswith("trainer.should_stop differs across ranks from global step 3 (epoch 0): "
                                      "rank 0 set it to True in on_train_batch_end at /user/model.py:42")
    assert "rank 1 did not (still False at that step)" in verdict.summary
    assert [e.rank for e in verdict.evidence] == [0, 1]
    assert "reduce_boolean_decision" in verdict.fix


def test_should_stop_at_the_same_step_on_every_rank_passes(fake_runs):
    values = [_value(_final()), _value(_final())]
    run = fake_runs.run(traces=[[_stop(3)], [_stop(3)]], values=values)
    assert decisions.stop_divergence(run) is None
    assert get_contract("sync-dist").judge(run).outcome == "passed"


def test_rank_that_never_reached_the_step_is_no_divergence(fake_runs):
    run = fake_runs.run(traces=[[_stop(3)], [{"ev": "hook", "i": 1, "name": "x", "step": 1}]])
    assert decisions.stop_divergence(run) is None


def test_learning_rates_that_part_ways_fail(fake_runs):
    start = {"epoch": 0, "step": 0, "hook": "on_train_epoch_start", "lrs": [[0.1]]}
    cut = {"epoch": 1, "step": 4, "hook": "on_train_epoch_start", "lrs": [[0.01]]}
    values = [_value(_final(), lr_changes=[start, cut]), _value(_final(), lr_changes=[start])]
    verdict = get_contract("sync-dist").judge(fake_runs.run(values=values))
    assert verdict.outcome == "failed"
    assert verdict.summary.startswith("the optimizers' learning rates differ across ranks from global step 4")
    assert [e.detail.rsplit(": ", 1)[1] for e in verdict.evidence] == ["[0.01]", "[0.1]"]
    same = [_value(_final(), lr_changes=[start, cut]), _value(_final(), lr_changes=[start, cut])]
    assert get_contract("sync-dist").judge(fake_runs.run(values=same)).outcome == "passed"


# -- 4. Lightning's batch-size inference ------------------------------------------------------------

def test_count_samples_learns_the_sample_tensor():
    import torch

    learned = {}
    full = {"x": torch.zeros(15, 4), "graph": torch.zeros(15), "y": torch.zeros(4)}
    assert count_samples(full, 4, learned, ("val", 0)) == {
        "inferred": 15, "samples": 4, "first": ["batch['x']", [15, 4]], "sample_path": "batch['y']"}
    last = {"x": torch.zeros(5, 4), "graph": torch.zeros(5), "y": torch.zeros(2)}
    assert count_samples(last, 4, learned, ("val", 0))["samples"] == 2
    assert count_samples((torch.zeros(4, 3), torch.zeros(4)), 4, {}, ("val", 0))["inferred"] == 4

    class Graphs:
        num_graphs = 3
        x = None

        def __iter__(self):
            return iter([("x", torch.zeros(11, 2))])

    assert count_samples(Graphs(), None, {}, ("train", 0))["samples"] == 3


def _weights(batches, sync=True):
    return {"run": RUN, "hook": "validation_step", "site": SITE, "sync_dist": sync, "batches": batches}


def test_epoch_mean_weighted_by_nodes_fails_with_both_values(fake_runs):
    def b(value, nodes):
        return {"value": value, "inferred": nodes, "samples": 4, "first": ["batch['x']", [nodes, 4]],
                "sample_path": "batch['y']"}

    rank0, rank1 = [b(0.2, 8), b(0.6, 48)], [b(0.3, 8), b(0.7, 48)]
    by_nodes = (0.2 * 8 + 0.6 * 48 + 0.3 * 8 + 0.7 * 48) / 112
    values = [_value(_final({"val_loss": by_nodes}), weights={"val_loss": _weights(r)}) for r in (rank0, rank1)]
    verdict = get_contract("sync-dist").judge(fake_runs.run(values=values))
    assert verdict.outcome == "failed"
    assert "batch['x'] (shape [8, 4]: 8), but the batch holds 4 samples (batch['y'])" in verdict.summary
    assert f"The epoch value is {by_nodes:.4f} instead of the per-sample mean 0.4500" in verdict.summary
    assert "(4 of 4 batches weighted by the wrong count)" in verdict.summary
    assert "batch_size=len(batch['y'])" in verdict.fix


def test_constant_wrong_count_changes_nothing_and_passes(fake_runs):
    batch = {"value": 0.5, "inferred": 12, "samples": 4, "first": ["batch['x']", [12, 4]], "sample_path": "batch['y']"}
    rows = [dict(batch, value=v) for v in (0.2, 0.4)]
    values = [_value(_final({"val_loss": 0.3}), weights={"val_loss": _weights(rows)}) for _ in range(2)]
    assert get_contract("sync-dist").judge(fake_runs.run(values=values)).outcome == "passed"


def test_should_stop_watcher_emits_the_assignment_and_is_removed():
    from pytest_ltconform.contracts.sync_dist.probe import SyncDistProbe

    class Recorder:
        trainer = None
        closed = False

        def __init__(self):
            self.events = []

        def emit(self, event):
            self.events.append(event)

        def current_hook(self):
            return "[LightningModule]Model.on_train_batch_end"

    class Trainer:
        def __init__(self):
            self.should_stop = False

    probe = SyncDistProbe()
    probe.recorder = Recorder()
    probe._watch_should_stop(Trainer)
    trainer = Trainer()
    trainer.should_stop = True  # this file is user code for the probe
    trainer.should_stop = True
    assert trainer.should_stop is True
    [event] = probe.recorder.events
    assert event["ev"] == "decision" and event["value"] is True and event["site"]["file"] == __file__
    probe._unwatch()
    assert "should_stop" not in vars(Trainer) and trainer.should_stop is True


# -- a monitored key logged on some ranks only: a rank's callback raises for want of it ------------

GUARDED = ("class Model:\n"
           "    def validation_step(self, batch, batch_idx):\n"
           "        if self.global_rank == 0:\n"
           "            self.log('val_acc', 1.0)\n")
NOT_FOUND = {
    "ModelCheckpoint": "`ModelCheckpoint(monitor='val_acc')` could not find the monitored key in the returned "
                       "metrics: ['epoch', 'step']. HINT: Did you call `log('val_acc', value)` in the "
                       "`LightningModule`?",
    "EarlyStopping": "Early stopping conditioned on metric `val_acc` which is not available. Pass in or modify "
                     "your `EarlyStopping` callback to use any of the following: `epoch`, `step`",
    "ReduceLROnPlateau": "ReduceLROnPlateau conditioned on metric val_acc which is not available. Available "
                         "metrics are: ['epoch', 'step']. Condition can be set using `monitor` key in lr "
                         "scheduler dict",
}
PEER = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:7361"


def _missing_key_run(fake_runs, tmp_path, callback="ModelCheckpoint", logged="val_acc"):
    path = tmp_path / "guarded.py"
    path.write_text(GUARDED)
    log = {"ev": "log", "name": logged, "hook": "validation_step", "user": True, "sync_dist": False,
           "rank_zero_only": False, "site": {"file": str(path), "line": 4, "func": "Model.validation_step"}}
    steps = [{"ev": "hook", "i": i, "h": i, "name": "[LightningModule]Model.validation_step"} for i in (1, 2)]
    exc = "MisconfigurationException" if callback != "EarlyStopping" else "RuntimeError"
    ranks = [fake_runs.rank(0, trace=[steps[0], log, steps[1], log], status="error", exc_type="RuntimeError",
                            message=PEER),
             fake_runs.rank(1, trace=steps, status="error", exc_type=exc, message=NOT_FOUND[callback])]
    return fake_runs.of(ranks, status="error")


@pytest.mark.parametrize("callback", list(NOT_FOUND))
def test_a_monitored_key_one_rank_never_logged_is_claimed_with_the_guarded_log_call(fake_runs, tmp_path, callback):
    from pytest_ltconform.contracts import blamed
    from pytest_ltconform.policies import judge

    run = _missing_key_run(fake_runs, tmp_path, callback)
    contract = get_contract("sync-dist")
    assert contract.blames(run) == Blame.LOG and blamed(run) == "sync-dist"
    verdict = judge(contract, run)
    assert verdict.outcome == "failed"
    assert verdict.summary.startswith("monitored key 'val_acc' is logged on rank 0 only and never on rank 1, in "
                                      "validation_step under `if self.global_rank == 0:` at ")
    assert "guarded.py:4 (Model.validation_step)" in verdict.summary and f"rank 1's {callback}" in verdict.summary
    assert [(e.rank, e.detail) for e in verdict.evidence][:2] == [(0, "'val_acc' logged 2 times"),
                                                                   (1, "'val_acc' never logged")]
    assert "sync_dist=True" in verdict.fix and "rank_zero_only=True is not enough" in verdict.fix
    assert "remove the `if self.global_rank == 0:` gate" in verdict.fix
    # The other items of the run name it: not judged in one line, or passed on the part before the stop.
    other = judge(get_contract("unused-parameters"), run)
    assert other.outcome == "not_judged" and other.category == "consequence" and "sync-dist[ddp]" in other.summary
    other = judge(get_contract("all-rank-save"), run)
    assert other.outcome == "passed" and other.partial and "sync-dist[ddp]" in other.notes[-1]


def test_a_monitored_key_no_rank_logged_is_the_users_typo_not_claimed(fake_runs, tmp_path):
    from pytest_ltconform.contracts import blamed
    from pytest_ltconform.policies import judge

    run = _missing_key_run(fake_runs, tmp_path, logged="val_loss")  # monitor='val_acc', logged 'val_loss'
    assert get_contract("sync-dist").blames(run) is None and blamed(run) is None
    verdict = judge(get_contract("all-rank-save"), run)
    assert verdict.outcome == "error" and "MisconfigurationException" in verdict.summary


def test_a_diverging_key_is_located_at_its_own_log_call_not_the_log_dict_above_it(fake_runs, tmp_path):
    """Issue 32: the evidence named the log_dict line above the self.log that logged the key the
    ranks disagree on. The line named is the diverging call's own frame, held against its source."""
    path = tmp_path / "model.py"
    path.write_text("class Model:\n    def on_validation_epoch_end(self):\n"
                    "        self.log_dict({'val_loss': 1.0}, sync_dist=True)\n"
                    "        self.log(f'val_acc_class{k}', 2.0, sync_dist=True)\n")
    at = lambda line: {"file": str(path), "line": line, "func": "Model.on_validation_epoch_end"}  # noqa: E731
    hook = {"ev": "hook", "i": 1, "h": 1, "name": "[LightningModule]Model.on_validation_epoch_end"}
    log = lambda name, line, via: {"ev": "log", "name": name, "h": 1, "site": at(line), "via": via,  # noqa: E731
                                   "sync_dist": True, "hook": "on_validation_epoch_end"}
    rank0 = [hook, log("val_loss", 3, "log_dict"), log("val_acc_class2", 4, "log"), {"ev": "hook_exit", "i": 1}]
    rank1 = [hook, log("val_loss", 3, "log_dict"), {"ev": "hook_exit", "i": 1}]
    verdict = get_contract("sync-dist").judge(fake_runs.run(traces=[rank0, rank1], values=[None, None]))
    assert verdict.outcome == "failed", verdict.render()
    assert verdict.summary.startswith("self.log(sync_dist=True) in Model.on_validation_epoch_end logs different key "
                                      "sets per rank: rank 0 {val_loss, val_acc_class2}, rank 1 {val_loss}, at "
                                      f"{path}:4 (Model.on_validation_epoch_end)"), verdict.summary
    assert f"{path}:3" not in verdict.summary
    assert claims.check({"contract": "sync-dist", **verdict.as_dict()}) == []
    # The line above, named as that call's, does not hold against its source.
    wrong = claims.claim("site", f"{path}:3", frame=at(3), call="log")
    assert "makes no log(...) call" in claims.check({"contract": "sync-dist", "message": f"{path}:3",
                                                    "claims": [wrong.as_dict()]})[0]
# -- a metric object chosen by the batch's content -------------------------------------------------

_CHOOSES = '''
class Model:
    def validation_step(self, batch, batch_idx):
        x, y, source = batch
        name = "clean" if int(source[0]) == 0 else "noisy"
        metric = self.metrics[name]
        metric.update(x, y)
        self.log(f"val_acc_{name}", metric, on_epoch=True)
'''


def test_metric_objects_logged_under_keys_that_differ_by_rank_fail(fake_runs, tmp_path):
    """Each rank logs the metric object its batches chose: at the epoch's end the ranks compute (and
    all-gather) different metrics. sync-dist names the keys per rank, the choosing lines and the
    collective that broke; it claims the stopped world."""
    path = tmp_path / "m.py"
    path.write_text(_CHOOSES)
    site = {"file": str(path), "line": 8, "func": "Model.validation_step"}

    def logs(name):
        return [{"ev": "log", "name": name, "hook": "validation_step", "site": site, "user": True, "vtype": "metric",
                 "sync_dist": False, "rank_zero_only": False, "on_step": False, "on_epoch": True, "sanity": True,
                 "epoch": 0} for _ in range(2)]

    ranks = [fake_runs.rank(0, logs("val_acc_clean"), status="error", exc_type="RuntimeError", message="stack"),
             fake_runs.rank(1, logs("val_acc_noisy"), status="error", exc_type="RuntimeError", message="stack")]
    run = fake_runs.of(ranks, status="error")
    run.job.mismatch = {"pg": "0", "seq": 9, "broke_at": 9,
                        "calls": {0: {"op": "allgather", "sizes": [[3]]}, 1: {"op": "allgather", "sizes": [[]]}}}
    contract = get_contract("sync-dist")
    assert contract.blames(run) == Blame.LOG
    verdict = contract.judge(run)
    assert verdict.outcome == "failed" and verdict.category == "deadlock", verdict.render()
    assert "rank 0 {val_acc_clean}, rank 1 {val_acc_noisy}" in verdict.summary
    assert f"the object logged is chosen at {path}:6" in verdict.summary
    assert "#9 (rank 0: allgather of sizes [[3]]; rank 1: allgather of sizes [[]])" in verdict.summary
    assert "name = " in verdict.render()  # the line that decided the key
    same = fake_runs.run([logs("val_acc_clean"), logs("val_acc_clean")])
    assert not contract._metric_key_failures(same)


def test_a_pass_names_every_logged_key_it_did_not_compare_and_why(fake_runs):
    """Issue 32, section 3: the pass listed only the synced keys, so an F1 from scikit-learn logged
    per batch without sync_dist read as compared."""
    def log(name, **over):
        return {"ev": "log", "name": name, "hook": "validation_step", "site": SITE, "sync_dist": False,
                "vtype": "float", "on_step": False, "on_epoch": True, "reduce_fx": "mean", **over}

    events = [log("val_loss", sync_dist=True, vtype="tensor"), log("val_f1"), log("val_recall"),
              log("train_loss", hook="training_step", on_step=True, on_epoch=False),
              log("val_auroc", vtype="metric"), log("val_max", reduce_fx="max")]
    values = [_value(_final()), _value(_final())]
    verdict = get_contract("sync-dist").judge(fake_runs.run(traces=[events, events], values=values))
    assert verdict.outcome == "passed", verdict.render()
    text = verdict.summary
    assert "synced log keys identical on every rank (val_loss)" in text
    assert ("'val_f1', 'val_recall' not compared: logged without sync_dist from values no recorded metric call "
            "(TorchMetrics, scikit-learn) produced") in text
    assert "'train_loss' not compared: logged per step only" in text
    assert "'val_auroc' not compared: TorchMetrics objects" in text
    assert "'val_max' not compared: reduced with max" in text


SKLEARN_F1 = """
import lightning.pytorch as L
import torch
from sklearn.metrics import f1_score
from torch.utils.data import DataLoader, TensorDataset


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] + 0.8 * torch.randn(n, generator=g) > 0).long())


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.binary_cross_entropy_with_logits(self.net(x).squeeze(1), y.float())

    def validation_step(self, batch, batch_idx):
        x, y = batch
        pred = (self.net(x).squeeze(1) > 0).long()
        self.log("val_f1", f1_score(y.numpy(), pred.numpy(), zero_division=0), on_epoch=True, batch_size=len(y))

    def train_dataloader(self):
        return DataLoader(_split(64, 3), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_split(64, 4), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
"""


def test_a_scikit_learn_metric_logged_per_batch_without_sync_dist_fails(pytester, no_leftover_ranks):
    """scikit-learn is tapped as the user's module imports it (not a dependency of the plugin: this test
    runs where it is installed)."""
    pytest.importorskip("sklearn")
    pytester.makepyfile(skl_case=SKLEARN_F1)
    result = pytester.runpytest_subprocess("--ltconform", "skl_case.py:Model", "--ltconform-strategies", "ddp",
                                           "-k", "sync-dist[", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*[[]sync-dist[]] FAILED (silently wrong values, no error): 'val_f1' logged from "
                                 "scikit-learn's f1_score on each batch in validation_step and not synced (no "
                                 "sync_dist)*rank 0's logged epoch value * is not the same metric over rank 0's 32 "
                                 "samples of the epoch*"])


def test_a_nonlinear_metric_logged_once_per_epoch_is_called_each_ranks_value_averaged_over_ranks(fake_runs):
    """Trial (average_precision_per_rank_averaged.py): AP computed in on_validation_epoch_end over each
    rank's own outputs and logged with sync_dist=True was said to be logged "on each batch" and
    "mean-reduced over batches", with "1 per-batch values" as evidence. It is each rank's one value,
    averaged across ranks by sync_dist; the Fix offers gathering the inputs."""
    import torch

    def ap(preds, target):
        from torchmetrics.functional.classification import binary_average_precision

        return [_part("binary_average_precision#0",
                      "torchmetrics.functional.classification.average_precision.binary_average_precision",
                      "functional binary_average_precision", [preds, target],
                      float(binary_average_precision(preds, target)))]

    blocks = [[(torch.cat([p for p, _ in rank]), torch.cat([t for _, t in rank]))] for rank in _blocks()]
    records = _records(ap, blocks, mode="single")
    for r in records:
        r["hook"] = "on_validation_epoch_end"
    logged = _epoch_value(records)
    values = [_value(_final({"val_ap": logged}), per_batch={"val_ap": r}) for r in records]
    verdict = get_contract("sync-dist").judge(fake_runs.run(values=values))
    assert verdict.outcome == "failed", verdict.render()
    assert verdict.summary.startswith(
        "'val_ap' logged from functional binary_average_precision once per epoch in on_validation_epoch_end and "
        "computed over each rank's own outputs and mean-reduced over ranks by sync_dist (nonlinear metric)"), \
        verdict.summary
    assert "each batch" not in verdict.summary and "over batches" not in verdict.summary
    assert [e.detail for e in verdict.evidence] == [
        "1 value logged in on_validation_epoch_end of the last epoch, over this rank's own outputs"] * 2
    assert "self.all_gather the inputs of binary_average_precision in on_validation_epoch_end" in verdict.fix
    assert claims.check({"contract": "sync-dist", **verdict.as_dict()}) == []


@pytest.mark.parametrize("hook", ["on_validation_epoch_end", "validation_step"])
def test_the_fix_for_an_unsynced_monitor_offers_sync_dist_only_for_a_plain_mean(fake_runs, hook):
    """Trial (checkpoint_monitor_rmse_from_rank_outputs.py): an RMSE each rank computes in its epoch
    end from its own outputs got the Fix "sync_dist=True", which averages the ranks' RMSEs (not the
    RMSE of the set). From an epoch-level hook the Fix gathers the outputs; from a step it says
    sync_dist=True for a plain mean and a TorchMetrics object otherwise."""
    reads = ([_read(0.5, 0, key="val_rmse"), _read(0.4, 1, key="val_rmse")],
             [_read(0.7, 0, key="val_rmse"), _read(0.6, 1, key="val_rmse")])
    run = _monitored_run(fake_runs, *reads, {"hook": hook}, key="val_rmse")
    verdict = get_contract("sync-dist").judge(run)
    assert verdict.outcome == "failed", verdict.render()
    if hook == "validation_step":
        assert "with sync_dist=True (and batch_size=...) where it is a plain mean" in verdict.fix
        assert "a TorchMetrics object where it is not" in verdict.fix
    else:
        assert verdict.fix.startswith("compute 'val_rmse' over every rank's outputs: self.all_gather the predictions "
                                      "and targets in on_validation_epoch_end before computing it"), verdict.fix
        assert "sync_dist=True averages the ranks' values" in verdict.fix
        assert "with sync_dist=True (and batch_size" not in verdict.fix


def test_a_pass_says_when_a_synced_keys_metric_calls_were_not_compared(fake_runs):
    """Trial (average_precision_per_rank_averaged.py, sync-dist[fsdp] at 7e38689): the pass said only
    "synced log keys identical on every rank (val_ap)" while the nonlinear check had compared nothing
    for 'val_ap'. The pass names what that check found for each synced key."""
    records = _records(_auroc_acc, _blocks())
    records[1]["run"] = ["validate", 2, False, 3]  # not the same loop on every rank: not compared
    log = {"ev": "log", "name": "val_score", "hook": "validation_step", "site": SITE, "sync_dist": True,
           "vtype": "tensor", "on_epoch": True, "reduce_fx": "mean"}
    values = [_value(_final({"val_score": _epoch_value(records)}), per_batch={"val_score": r}) for r in records]
    verdict = get_contract("sync-dist").judge(fake_runs.run(traces=[[log], [log]], values=values))
    assert verdict.outcome == "passed", verdict.render()
    assert ("'val_score' (synced) not compared: its metric calls were not recorded in the same loop on every rank"
            in verdict.summary), verdict.summary


def test_a_nonlinear_value_is_judged_from_the_validation_snapshot_when_a_later_stage_reset_the_metrics(fake_runs):
    """Trial (average_precision_per_rank_averaged.py, sync-dist[fsdp] at 7e38689): the final
    callback_metrics were empty (a later stage resets them), so the per-rank AP averaged by sync_dist
    was never compared and the item passed. The value published where that validation ended is
    the one judged."""
    records = _records(_auroc_acc, _blocks())
    logged = _epoch_value(records)
    snaps = [{"event": "validation_end", "epoch": 0, "step": 4, "metrics": {"val_score": 0.1}, "should_stop": False},
             {"event": "validation_end", "epoch": 1, "step": 8, "metrics": {"val_score": logged},
              "should_stop": False}]
    values = [_value(_final({}), per_batch={"val_score": r}, snapshots=snaps) for r in records]
    verdict = get_contract("sync-dist").judge(fake_runs.run(values=values))
    assert verdict.outcome == "failed", verdict.render()
    assert f"logged epoch value {logged:.4f}" in verdict.summary
    # No snapshot of that validation either: not compared, and the pass says so.
    values = [_value(_final({}), per_batch={"val_score": r}, snapshots=snaps[:1]) for r in records]
    log = {"ev": "log", "name": "val_score", "hook": "validation_step", "site": SITE, "sync_dist": True,
           "vtype": "tensor", "on_epoch": True, "reduce_fx": "mean"}
    verdict = get_contract("sync-dist").judge(fake_runs.run(traces=[[log], [log]], values=values))
    assert verdict.outcome == "passed", verdict.render()
    assert "'val_score' (synced) not compared: no epoch value of its loop was recorded" in verdict.summary


@pytest.mark.parametrize("v0, v1, word, where", [(float("nan"), float("nan"), "NaN", "ranks 0 and 1"),
                                                 (float("inf"), float("inf"), "inf", "ranks 0 and 1"),
                                                 (float("inf"), 0.5, "inf", "rank 0")])
def test_a_monitor_read_as_nan_or_inf_is_not_judged_and_says_so(fake_runs, v0, v1, word, where):
    """Trial 19:40's kind: a NaN or inf compares nothing. inf on every rank was "equal on every rank"
    (inf - inf is nan, never above the tolerance); inf against 0.5 was a difference."""
    synced = {"sync_dist": True}
    run = _monitored_run(fake_runs, [_read(v0, 0)], [_read(v1, 0)], synced)
    verdict = get_contract("sync-dist").judge(run)
    assert verdict.outcome == "passed", verdict.render()  # the synced log call is still judged
    assert (f"monitored 'train_loss' is not judged, because the value is {word} on {where} at 1 of its 1 read(s) "
            "(read by EarlyStopping in on_train_epoch_end at epoch 0)") in verdict.summary
    assert "equal on every rank at" not in verdict.summary
    assert claims.check({"contract": "sync-dist", **verdict.as_dict()}) == []


def test_a_read_or_metric_in_a_probes_own_fit_is_not_the_users_runs(tmp_path):
    """Trial 19:58: sync-dist[fsdp] listed "'val_loss' read by ReduceLROnPlateau ... at epoch 2" after a
    2-epoch fit: the read came from all-rank-save's sharded resume fit, which runs with the recorder
    paused. Reads and metric values taken while it is paused are not recorded as the user's."""
    import types

    import torch

    from pytest_ltconform.contracts.sync_dist.probe import SyncDistProbe
    from pytest_ltconform.trace import Recorder

    probe = SyncDistProbe()
    probe.recorder = Recorder(str(tmp_path / "trace.jsonl"), 0)
    trainer = types.SimpleNamespace(callbacks=[], current_epoch=1, global_step=8, sanity_checking=False)
    probe._read("ReduceLROnPlateau", None, "val_loss", trainer, lambda: 0.5, hook="lr_scheduler_step")
    probe._tap(torch.tensor(0.5), {"label": "metric"})
    with probe.recorder.paused():
        trainer.current_epoch = 2
        probe._read("ReduceLROnPlateau", None, "val_loss", trainer, lambda: 0.25, hook="lr_scheduler_step")
        probe._tap(torch.tensor(0.25), {"label": "metric"})
    assert [(r["epoch"], r["value"]) for r in probe.state["reads"]] == [(1, 0.5)]
    assert [t["value"] for t in probe.step_taps] == [0.5]


def _compute_log(name, synced, **over):
    return {"ev": "log", "name": name, "hook": "on_validation_epoch_end", "site": SITE, "sync_dist": False,
            "vtype": "tensor", "on_step": False, "on_epoch": True, "reduce_fx": "mean",
            "metric_compute": {"metric": "BinaryAveragePrecision", "synced": synced}, **over}


@pytest.mark.parametrize("vtype", ["tensor", "float"])
def test_a_metric_compute_value_that_synced_is_not_called_rank_zeros_own(fake_runs, vtype):
    """Issue 32 field trial: the value of a Metric's compute() (which gathered its state over the ranks)
    logged without sync_dist was called "rank 0's own mean"; only a value that neither sync_dist nor
    the Metric synced is rank 0's own, and the sentence rests on the recorded sync."""
    events = [_compute_log("val_ap", True, vtype=vtype), _compute_log("val_ap_local", False, vtype=vtype)]
    values = [_value(_final()), _value(_final())]
    verdict = get_contract("sync-dist").judge(fake_runs.run(traces=[events, events], values=values))
    assert verdict.outcome == "passed", verdict.render()
    text = verdict.summary
    assert ("'val_ap' not compared: the value BinaryAveragePrecision.compute() returned, synced over the ranks "
            "by the Metric (its compute() was recorded gathering the state first)") in text
    assert "'val_ap_local' not compared: not synced: BinaryAveragePrecision.compute() did not gather" in text
    assert text.count("rank 0's own") == 1
    record = {"contract": "sync-dist", "message": verdict.render(), "claims": [c.as_dict() for c in verdict.claims],
              "evidence": []}
    assert claims.check(record) == []
    assert "'val_ap' logged as Python floats" not in " ".join(verdict.notes)


def test_rank_zeros_own_is_false_of_a_value_a_metric_synced():
    text = "Lightning publishes rank 0's own mean"
    log = {"sync_dist": False, "rank_zero_only": False, "vtype": "tensor", "metric": "AP", "metric_synced": True}
    record = {"contract": "sync-dist", "message": text, "claims": [claims.claim("local", text, log=log).as_dict()]}
    assert "was synced" in claims.check(record)[0]
    # Said with no claim (the sentence as it was before): the consistency check names it.
    assert "no local claim" in claims.check({"contract": "sync-dist", "message": text, "claims": []})[0]


METRIC_COMPUTE_AP = """
import lightning.pytorch as L
import torch
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] + 0.8 * torch.randn(n, generator=g) > 0).long())


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.ap = torchmetrics.AveragePrecision(task="binary")

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.binary_cross_entropy_with_logits(self.net(x).squeeze(1), y.float())

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.ap.update(torch.sigmoid(self.net(x).squeeze(1)), y)

    def on_validation_epoch_end(self):
        self.log("val_ap", self.ap.compute())
        self.ap.reset()

    def train_dataloader(self):
        return DataLoader(_split(64, 3), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_split(64, 4), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
"""


def test_a_metric_compute_logged_without_sync_dist_is_said_synced_by_the_metric(pytester, no_leftover_ranks):
    """The ok_ twin of the field trial: AveragePrecision's compute() syncs over the ranks; the pass says
    so from the recorded gather, and never "rank 0's own"."""
    pytester.makepyfile(ap_case=METRIC_COMPUTE_AP)
    result = pytester.runpytest_subprocess("--ltconform", "ap_case.py:Model", "--ltconform-strategies", "ddp",
                                           "-k", "sync-dist[", "-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*'val_ap' not compared: the value BinaryAveragePrecision.compute() returned, "
                                 "synced over the ranks by the Metric*"])
    assert "rank 0's own" not in result.stdout.str()
