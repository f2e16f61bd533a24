"""eval-duplication: verdicts over recorded sampler indices, metrics and writes (fast), and one real world."""

from __future__ import annotations

import pytest
from conftest import case

from pytest_ltconform import claims
from pytest_ltconform.contracts import get_contract


def _loader(indices, n, sampler="DistributedSampler", total=None, batches=None):
    out = {"indices": indices, "dataset_len": n, "sampler": sampler, "total_size": total or n}
    if batches is not None:
        out["batches"] = batches
    return out


def _stage(loaders, returned=None, metric_samples=None, writes=None):
    return {"loaders": loaders, "returned": [returned or {}], "metric_samples": metric_samples or {},
            "writes": writes or [], "callback_metrics": returned or {}}


def _values(stage_records, driver=("validate",)):
    """Each rank's returned value: the eval probe's records of its stages (``stage_records[r]``)."""
    return [{"eval": {"stages": stages, "driver": list(driver), "limited": False}} for stages in stage_records]


def judge(run):
    return get_contract("eval-duplication").judge(run)


def test_padded_indices_fail_with_duplicates_counts_and_both_values(fake_runs):
    ranks = [{"validate": _stage([_loader([0, 2, 4], 5, total=6)], {"val_acc": 0.5},
                                 {"auroc": {"type": "BinaryAUROC", "n": 3}})},
             {"validate": _stage([_loader([1, 3, 0], 5, total=6)], {"val_acc": 0.5},
                                 {"auroc": {"type": "BinaryAUROC", "n": 3}})}]
    ref_stages = {"validate": _stage([_loader([0, 1, 2, 3, 4], 5, sampler="SequentialSampler")], {"val_acc": 0.4})}
    ref = fake_runs.run(values=_values([ref_stages]), kind="eval-reference")
    v = judge(fake_runs.run(values=_values(ranks), kind="eval", reference=ref))
    assert v.outcome == "failed" and v.category == "silent"
    text = v.render()
    assert "index 0 on ranks 0 and 1" in text
    assert "6 evaluations for 5 distinct samples" in text and "pads 5 indices to 6" in text
    assert "val_acc 0.5 on 2 ranks vs 0.4 on 1 device" in text
    assert "BinaryAUROC `auroc` was updated with 6 samples for 5 distinct" in text


def test_rank_zero_shard_metric_fails_with_coverage(fake_runs):
    log = {"ev": "log", "name": "val_acc", "hook": "on_validation_epoch_end", "rank_zero_only": True,
           "sync_dist": False, "user": True, "site": {"file": "/x/m.py", "line": 42, "func": "f"}}
    ranks = [{"validate": _stage([_loader(list(range(0, 32, 2)), 32)], {"val_acc": 0.625})},
             {"validate": _stage([_loader(list(range(1, 32, 2)), 32)], {"val_acc": 0.3125})}]
    ref_stages = {"validate": _stage([_loader(list(range(32)), 32)], {"val_acc": 0.46875})}
    ref = fake_runs.run(values=_values([ref_stages]), kind="eval-reference")
    v = judge(fake_runs.run([[log], []], _values(ranks), kind="eval", reference=ref))
    assert v.outcome == "failed"
    text = v.render()
    assert "16 of 32 validation samples" in text and "rank_zero_only=True" in text
    assert "m.py:42" in text and "vs 0.4688 on 1 device" in text


def test_a_metric_logged_on_step_and_on_epoch_names_its_log_line(fake_runs):
    """self.log("val_loss", on_step=True, on_epoch=True) publishes val_loss_epoch; the evidence names
    that call's line, and every such metric is named (field trial: srai's val_loss and val_f1)."""
    def log(name, line):
        return {"ev": "log", "name": name, "hook": "validation_step", "rank_zero_only": False, "sync_dist": False,
                "on_step": True, "on_epoch": True, "user": True,
                "site": {"file": "/x/model.py", "line": line, "func": "Model.validation_step"}}

    ranks = [{"validate": _stage([_loader(list(range(0, 32, 2)), 32)], {"val_loss_epoch": 0.7, "val_f1_epoch": 0.5})},
             {"validate": _stage([_loader(list(range(1, 32, 2)), 32)], {"val_loss_epoch": 0.8, "val_f1_epoch": 0.6})}]
    ref_stages = {"validate": _stage([_loader(list(range(32)), 32)], {"val_loss_epoch": 0.75, "val_f1_epoch": 0.55})}
    ref = fake_runs.run(values=_values([ref_stages]), kind="eval-reference")
    v = judge(fake_runs.run([[log("val_loss", 173), log("val_f1", 174)], []], _values(ranks), kind="eval",
                            reference=ref))
    assert v.outcome == "failed"
    text = v.render()
    assert "val_loss_epoch 0.7 on rank 0" in text and "model.py:173 (Model.validation_step)" in text
    assert "val_f1_epoch 0.5 on rank 0" in text and "model.py:174 (Model.validation_step)" in text
    assert "logged in validation_step with no sync" in text


def _predict_ranks():
    write = {"path": "predictions.csv", "stage": "predict", "lines": 5,
             "site": {"file": "/x/m.py", "line": 68, "func": "Model.on_predict_epoch_end"}}
    return [{"predict": _stage([_loader([0, 2, 4, 6], 7)], writes=[write])},
            {"predict": _stage([_loader([1, 3, 5], 7)])}]


def test_rank_zero_file_from_own_shard_fails(fake_runs):
    v = judge(fake_runs.run(values=_values(_predict_ranks(), ("predict",)), kind="eval"))
    assert v.outcome == "failed"
    text = v.render()
    assert "covers 4 of 7 prediction samples" in text and "ids [1, 3, 5]" in text


def test_rank_zero_file_after_a_gather_passes(fake_runs):
    trace = [{"ev": "eval_stage", "name": "predict", "at": "start"},
             {"ev": "call", "op": "all_gather_object", "user": True},
             {"ev": "eval_stage", "name": "predict", "at": "end"}]
    v = judge(fake_runs.run([trace, []], _values(_predict_ranks(), ("predict",)), kind="eval"))
    assert v.outcome == "passed", v.render()


def test_a_file_written_before_the_stages_first_batch_is_no_output(fake_runs):
    """Issue 38 §4: a per-rank file written in setup() (its name holds the pid, so each rank writes
    its own, and rank 0's holds no outputs) is not a file rank 0 publishes from its shard."""
    ranks = _predict_ranks()
    ranks[0]["predict"]["writes"][0].update(path="worker-11840.json", outputs=False)
    v = judge(fake_runs.run(values=_values(ranks, ("predict",)), kind="eval"))
    assert v.outcome == "passed", v.render()
    ranks[0]["predict"]["writes"][0]["outputs"] = True
    assert judge(fake_runs.run(values=_values(ranks, ("predict",)), kind="eval")).outcome == "failed"


def test_writes_are_outputs_once_the_stages_first_batch_started(tmp_path, monkeypatch):
    """The rank side tells a write before the first batch (setup) from one during or after it."""
    import time

    from pytest_ltconform.contracts.eval_duplication import probe

    early, late, reopened = (tmp_path / n for n in ("setup.json", "preds.csv", "log.txt"))
    for f in (early, late, reopened):
        f.write_text("x\n")
    old = time.time() - 60
    import os

    os.utime(early, (old, old))
    os.utime(reopened, (old, old))
    first = time.time() - 30
    monkeypatch.setattr(probe, "_ACTIVE", {"first_batch_at": first, "writes": [
        {"path": "setup.json", "abs": str(early), "after_batch": False},
        {"path": "preds.csv", "abs": str(late), "after_batch": True},
        {"path": "log.txt", "abs": str(reopened), "after_batch": False},
        {"path": "log.txt", "abs": str(reopened), "after_batch": True}]})
    writes = {w["path"]: w["outputs"] for w in probe._stage_writes()}
    assert writes == {"setup.json": False, "preds.csv": True, "log.txt": True}


def test_a_pass_that_compared_nothing_with_the_one_device_run_says_why(fake_runs):
    """Issue 38 §4: an exactly-once pass left out its comparison with the one-device run silently."""
    from pytest_ltconform import claims

    ranks = [{"validate": _stage([_loader([0, 2], 4)])}, {"validate": _stage([_loader([1, 3], 4)])}]
    v = judge(fake_runs.run(values=_values(ranks), kind="eval"))
    assert v.outcome == "passed", v.render()
    assert "no value was compared with the one-device run: the one-device run gave no values" in v.summary
    assert claims.check({"contract": v.contract, **v.as_dict()}) == []


def test_even_shards_with_equal_values_pass(fake_runs):
    ranks = [{"validate": _stage([_loader([0, 2, 4, 6], 7, sampler="StridedNoPad")], {"val_acc": 0.75})},
             {"validate": _stage([_loader([1, 3, 5], 7, sampler="StridedNoPad")], {"val_acc": 0.75})}]
    ref_stages = {"validate": _stage([_loader(list(range(7)), 7)], {"val_acc": 0.75})}
    ref = fake_runs.run(values=_values([ref_stages]), kind="eval-reference")
    v = judge(fake_runs.run(values=_values(ranks), kind="eval", reference=ref))
    assert v.outcome == "passed"
    assert "every index 0..6 evaluated exactly once" in v.summary and "val_acc 0.75 on 2 ranks = 0.75" in v.summary


@pytest.mark.slow
def test_padded_validation_fails_in_a_real_world(pytester, no_leftover_ranks):
    path = case("eval-duplication/padded_val_accuracy.py").rsplit(":", 1)[0]
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ltconform", f"{path}:Model",
                                           "--ltconform-datamodule", f"{path}:DataModule",
                                           "-k", "eval-duplication[ and not gpu and not multinode", "-v")
    out = result.stdout.str()
    result.assert_outcomes(failed=1)
    assert "index 0 on ranks 0 and 1" in out and "on 1 device with the same weights" in out


def _read(use, hook="validation_step"):
    how = {"select": "a subscript (it picks this rank's rows)",
           "gate": "the test of an if (it gates what runs, it selects no data)"}[use]
    return {"ev": "rank_read", "hook": hook, "what": "self.global_rank", "use": use, "how": how,
            "site": {"file": "/x/tsmixer.py", "line": 30, "func": "Model._shard"}}


def _same_indices(reads, returned=({"val_loss": 0.5}, {"val_loss": 0.5})):
    out = []
    for r in range(2):
        stage = _stage([_loader(list(range(8)), 8, sampler="SequentialSampler")], returned[r])
        stage["rank_reads"] = reads[r]
        out.append({"validate": stage})
    return out


def test_same_indices_split_by_rank_in_the_step_pass_with_a_note(fake_runs):
    ref_stages = {"validate": _stage([_loader(list(range(8)), 8, sampler="SequentialSampler")], {"val_loss": 0.5})}
    ref = fake_runs.run(values=_values([ref_stages]), kind="eval-reference")
    ranks = _same_indices([[_read("select")], [_read("select")]])
    v = judge(fake_runs.run(values=_values(ranks), kind="eval", reference=ref))
    assert v.outcome == "passed", v.render()
    assert "every rank's loader gives it the same 8 indices and validation_step selects each rank's rows" in v.summary
    note = " ".join(v.notes)
    assert "validation_step reads self.global_rank at /x/tsmixer.py:30 (Model._shard) as a subscript" in note
    assert "the split between ranks happens inside the step, which this check does not see" in note


def test_same_indices_split_in_the_step_with_an_unsynced_rank_zero_metric_fail(fake_runs):
    ref_stages = {"validate": _stage([_loader(list(range(8)), 8, sampler="SequentialSampler")], {"val_loss": 0.5})}
    ref = fake_runs.run(values=_values([ref_stages]), kind="eval-reference")
    ranks = _same_indices([[_read("select")], [_read("select")]], ({"val_loss": 0.4}, {"val_loss": 0.6}))
    v = judge(fake_runs.run(values=_values(ranks), kind="eval", reference=ref))
    assert v.outcome == "failed"
    assert ("val_loss published from rank 0 is computed from rank 0's shard alone: rank 0's rows of each batch "
            "(validation_step selects them by rank at /x/tsmixer.py:30 (Model._shard))") in v.summary


def test_same_indices_without_a_selecting_read_stay_duplicates(fake_runs):
    for reads in ([[], []], [[_read("gate")], [_read("gate")]], [[_read("select")], []],
                  [[_read("select", "training_step")]] * 2):
        v = judge(fake_runs.run(values=_values(_same_indices(reads)), kind="eval"))
        assert v.outcome == "failed", v.render()
        assert "8 sample indices evaluated more than once across ranks: 16 evaluations for 8 distinct" in v.summary


def _whole_set(batches):
    """Both ranks evaluate all 8 samples in ``batches`` batches; val_loss equals the one-device value."""
    ref_stages = {"validate": _stage([_loader(list(range(8)), 8, "SequentialSampler", batches=batches)],
                                     {"val_loss": 0.5})}
    ranks = [{"validate": _stage([_loader(list(range(8)), 8, "SequentialSampler", batches=batches)],
                                 {"val_loss": 0.5})} for _ in range(2)]
    return ranks, ref_stages


def test_whole_set_on_every_rank_with_a_batch_per_rank_fails(fake_runs):
    ranks, ref_stages = _whole_set(batches=4)
    ref = fake_runs.run(values=_values([ref_stages]), kind="eval-reference")
    v = judge(fake_runs.run(values=_values(ranks), kind="eval", reference=ref))
    assert v.outcome == "failed", v.render()
    assert ("every rank evaluates the whole set: all 8 samples on each of the 2 ranks (4 batches per rank, "
            "SequentialSampler), so each sample is evaluated 2 times") in v.summary
    assert "val_loss 0.5" in v.summary and "use_distributed_sampler=True" in v.fix


def test_whole_set_repeated_with_equal_values_is_repeated_work_not_silently_wrong(fake_runs):
    """Issue 32: "FAILED (silently wrong values, no error)" over a stream evaluated on every rank whose
    message says the published values equal the single-device ones. The label follows the measure."""
    ranks, ref_stages = _whole_set(batches=4)
    ref = fake_runs.run(values=_values([ref_stages]), kind="eval-reference")
    v = judge(fake_runs.run(values=_values(ranks), kind="eval", reference=ref))
    assert v.outcome == "failed" and v.category == "repeated", v.render()
    head = v.render().splitlines()[0]
    assert "silently wrong values" not in head and "repeated work" in head, head
    assert "the published values equal the single-device ones (val_loss 0.5 on 2 ranks = 0.5 on 1 device)" in \
        v.summary
    record = {"contract": "eval-duplication", **v.as_dict()}
    assert claims.check(record) == []
    # The old headline over the same facts contradicts them.
    record["claims"] = [c for c in record["claims"] if c["kind"] != "label"] + [
        claims.label_claim("silent").as_dict()]
    record["message"] = record["message"].replace(head, "[eval-duplication] FAILED (silently wrong values, "
                                                        "no error): x")
    assert any("measure the published values equal" in p for p in claims.check(record)), claims.check(record)


def test_a_duplicate_under_an_unsynced_metric_names_rank_zero_and_where_the_difference_comes_from(fake_runs):
    """Issue 32: '0.2599 on 2 ranks vs 0.2484 on 1 device' used rank 0's own unsynced value as if
    it were every rank's; and the duplicated-sample part is told apart from the rank-local part."""
    ranks = [{"validate": _stage([_loader([0, 2, 4], 5, total=6)], {"val_acc": 0.2599})},
             {"validate": _stage([_loader([1, 3, 0], 5, total=6)], {"val_acc": 0.2411})}]
    ref_stages = {"validate": _stage([_loader([0, 1, 2, 3, 4], 5, sampler="SequentialSampler")], {"val_acc": 0.2484})}
    ref = fake_runs.run(values=_values([ref_stages]), kind="eval-reference")
    v = judge(fake_runs.run(values=_values(ranks), kind="eval", reference=ref))
    text = v.render()
    assert "on 2 ranks vs" not in text
    assert ("val_acc 0.2599 on rank 0 (rank 1: 0.2411) vs 0.2484 on 1 device with the same weights (difference "
            "+0.0115): rank 0's own value (not synced): the difference is rank 0's shard alone (rank-local), not "
            "the duplicated samples") in text, text
    assert claims.check({"contract": "eval-duplication", **v.as_dict()}) == []
    old = text.replace("val_acc 0.2599 on rank 0 (rank 1: 0.2411) vs", "val_acc 0.2599 on 2 ranks vs")
    assert any("no rank-value claim" in p for p in claims.check({"contract": "eval-duplication", "message": old}))


def test_whole_set_with_fewer_batches_than_ranks_passes_with_a_note(fake_runs):
    ranks, ref_stages = _whole_set(batches=1)
    ref = fake_runs.run(values=_values([ref_stages]), kind="eval-reference")
    v = judge(fake_runs.run(values=_values(ranks), kind="eval", reference=ref))
    assert v.outcome == "passed", v.render()
    assert "every rank evaluates all 8 samples and the published values equal the single-device ones" in v.summary


def test_an_iterable_evaluation_set_alone_is_not_judged(fake_runs):
    stream = {"iterable": True, "dataset": "RecordStream", "sampler": "_InfiniteConstantSampler",
              "indices": None, "dataset_len": None}
    ranks = [{"validate": _stage([dict(stream)], {"val_loss": 0.5})} for _ in range(2)]
    v = judge(fake_runs.run(values=_values(ranks), kind="eval"))
    assert v.outcome == "not_judged", v.render()
    assert v.summary == ("not judged: cannot tell samples apart in validation: IterableDataset RecordStream "
                         "(no dataset indices to read).")


def _batch(*leaves):
    """A content fingerprint as the probe records it: ``leaves`` are (digest, numel, floating)."""
    return {"fp": "+".join(d for d, _, _ in leaves), "leaves": [list(leaf) for leaf in leaves]}


def _content_stage(stream, info, returned=None):
    rec = _stage([dict(info)], returned or {"val_loss": 0.5})
    rec["contents"] = {"0": stream}
    return rec


_DICT_LOADER = {"indices": None, "dataset_len": 10, "sampler": None, "dataset": "DictDataset", "loader": "DictLoader"}
_STREAM = {"iterable": True, "dataset": "TripleStream", "sampler": "_InfiniteConstantSampler", "indices": None,
           "dataset_len": None, "loader": "DataLoader"}


def test_same_stream_on_every_rank_without_a_sampler_fails_by_content(fake_runs):
    # pykeen-like batches: positives (the samples) equal on both ranks, negatives drawn per rank
    ranks = [{"validate": _content_stage([_batch(("pos0", 24, False), (f"neg0r{r}", 48, False)),
                                          _batch(("pos1", 24, False), (f"neg1r{r}", 48, False))], _DICT_LOADER)}
             for r in range(2)]
    v = judge(fake_runs.run(values=_values(ranks), kind="eval"))
    assert v.outcome == "failed", v.render()
    assert ("validation: every rank evaluates the same stream: the 2 batches each rank's validation loop received "
            "are the same on all 2 ranks, so each sample is evaluated 2 times") in v.summary
    assert ("established by content: DictLoader without a sampler hands out no dataset indices, so the batches "
            "were fingerprinted as the loop received them, and tensor 0 of each batch (integer, 24 values) is the "
            "same on every rank") in v.summary
    assert "get_rank()" in v.fix
    ranks_with_evidence = sorted(e.rank for e in v.evidence if e.rank is not None)
    assert ranks_with_evidence == [0, 1]


def test_stream_split_by_rank_passes_by_content(fake_runs):
    ranks = [{"validate": _content_stage([_batch((f"x{r}{b}", 16, True), ("mask", 4, False)) for b in range(3)],
                                         _STREAM)} for r in range(2)]
    v = judge(fake_runs.run(values=_values(ranks), kind="eval"))
    assert v.outcome == "passed", v.render()
    assert v.summary == ("validation: no batch reached two ranks (rank 0: 3, rank 1: 3 batches, compared by content: "
                         "IterableDataset TripleStream hands out no dataset indices).")


def test_constant_leaf_alone_never_makes_the_same_stream(fake_runs):
    # the mask is the same on both ranks but repeats within a rank: it tells no batch apart
    ranks = [{"validate": _content_stage([_batch((f"x{r}{b}", 16, True), ("mask", 16, True)) for b in range(2)],
                                         _STREAM)} for r in range(2)]
    v = judge(fake_runs.run(values=_values(ranks), kind="eval"))
    assert v.outcome == "passed", v.render()


def test_a_batch_on_two_ranks_of_a_stream_fails_by_content(fake_runs):
    streams = [[_batch(("a", 16, True)), _batch(("b", 16, True))], [_batch(("c", 16, True)), _batch(("a", 16, True))]]
    ranks = [{"validate": _content_stage(s, _STREAM)} for s in streams]
    v = judge(fake_runs.run(values=_values(ranks), kind="eval"))
    assert v.outcome == "failed", v.render()
    assert v.summary.startswith("validation: 1 batch(es) reached more than one rank with the same content "
                                "(rank 0: 2, rank 1: 2 batches; established by content: IterableDataset TripleStream")


def test_same_stream_of_one_batch_with_equal_values_passes_with_a_note(fake_runs):
    ranks = [{"validate": _content_stage([_batch(("x", 16, True))], _DICT_LOADER)} for _ in range(2)]
    ref_stages = {"validate": _content_stage([_batch(("x", 16, True))], _DICT_LOADER)}
    ref = fake_runs.run(values=_values([ref_stages]), kind="eval-reference")
    v = judge(fake_runs.run(values=_values(ranks), kind="eval", reference=ref))
    assert v.outcome == "passed", v.render()
    assert "every rank evaluates the same 1 batch, fewer than the 2 ranks" in v.summary


def test_batches_repeating_within_a_rank_are_not_judged_with_that_reason(fake_runs):
    ranks = [{"validate": _content_stage([_batch(("z", 2, False), (f"n{r}{b}", 2, False)) for b in range(2)]
                                         + [_batch(("z", 2, False), (f"n{r}0", 2, False))], _STREAM)}
             for r in range(2)]
    v = judge(fake_runs.run(values=_values(ranks), kind="eval"))
    assert v.outcome == "not_judged", v.render()
    assert v.summary == ("not judged: cannot tell samples apart in validation: IterableDataset TripleStream, its "
                         "batches repeat within a rank, so their content does not tell them apart (no dataset "
                         "indices to read).")


@pytest.mark.slow
def test_iterable_stream_on_every_rank_fails_by_content_in_a_real_world(pytester, no_leftover_ranks):
    path = case("eval-duplication/iterable_val_stream_every_rank.py").rsplit(":", 1)[0]
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ltconform", f"{path}:Model",
                                           "--ltconform-datamodule", f"{path}:DataModule",
                                           "-k", "eval-duplication[ and not gpu and not multinode", "-v")
    out = result.stdout.str()
    result.assert_outcomes(failed=1)
    assert "every rank evaluates the same stream: the 3 batches each rank's validation loop received" in out
    assert "established by content: IterableDataset TripleStream" in out
    assert "content fingerprints [" in out and "rank 1: this rank's validation loop received 3 batches" in out


def _padded_with_rows(rows_per_rank, built=None):
    loaders = [_loader([0, 2, 4], 5, total=6), _loader([1, 3, 0], 5, total=6)]
    for loader in loaders:
        loader["built"] = built
    return [{"validate": _stage([loader], {"val_acc": 0.5}, {"mae": {"type": "MeanAbsoluteError", "n": rows}})}
            for loader, rows in zip(loaders, rows_per_rank)]


def test_metric_rows_that_are_not_samples_are_not_counted_as_samples(fake_runs):
    # Two rows per sample (a window of two time steps): 6 rows per rank for its 3 samples.
    v = judge(fake_runs.run(values=_values(_padded_with_rows([6, 6])), kind="eval"))
    assert v.outcome == "failed"
    text = v.render()
    assert "MeanAbsoluteError `mae` was updated with every validation batch of every rank" in text
    assert "not counted as samples" in text and "12 samples" not in text and "updated with 6" not in text


def test_the_loader_is_named_where_it_was_built_not_where_its_hook_is(fake_runs):
    built = {"site": {"file": "/pkg/loaders.py", "line": 87, "func": "build_dataloader"}, "cls": "DataLoader",
             "torch_loader": True}
    v = judge(fake_runs.run(values=_values(_padded_with_rows([3, 3], built)), kind="eval"))
    text = v.render()
    assert "/pkg/loaders.py:87 (build_dataloader): the validation DataLoader is built here, and Lightning wraps it " \
           "in DistributedSampler" in text
    assert "updated with 6 samples for 5 distinct" in text


STATEFUL = '''
import os

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class Ids(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.tensor([float(i)])


class Sliding(Sampler):
    """A sampler with state: each pass hands out the next 4 indices (not split by rank)."""

    def __init__(self):
        self.passes = 0

    def __iter__(self):
        start, self.passes = self.passes, self.passes + 1
        return iter(range(start, start + 4))

    def __len__(self):
        return 4


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.sampler = Sliding()
        self.seen = []

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        if self.trainer.state.fn == "validate":
            self.seen += [int(v) for v in batch.flatten()]
        self.log("val_loss", self.layer(batch).pow(2).mean(), sync_dist=True)

    def on_validation_epoch_end(self):
        if self.trainer.state.fn == "validate" and self.trainer.world_size > 1:  # not the one-device run
            with open(os.path.join(os.environ["SEEN_DIR"], f"seen{self.global_rank}.txt"), "w") as fh:
                fh.write(" ".join(map(str, self.seen)))

    def train_dataloader(self):
        return DataLoader(Ids(), batch_size=4)

    def val_dataloader(self):
        return DataLoader(Ids(), batch_size=2, sampler=self.sampler)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer_kwargs():
    return {"use_distributed_sampler": False, "max_epochs": 1}
'''


@pytest.mark.slow
def test_indices_are_the_ones_the_evaluation_loop_fetched_from_a_sampler_with_state(pytester, monkeypatch,
                                                                                    no_leftover_ranks):
    """Reading the sampler again before the stage drew another pass than the loop evaluated."""
    pytester.makepyfile(stateful=STATEFUL)
    monkeypatch.setenv("SEEN_DIR", str(pytester.path))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ltconform", "stateful:Model",
                                           "--ltconform-trainer", "stateful:trainer_kwargs",
                                           "-k", "eval-duplication[ and not gpu and not multinode", "-v")
    out = result.stdout.str()
    result.assert_outcomes(failed=1)
    for rank in (0, 1):
        seen = [int(v) for v in (pytester.path / f"seen{rank}.txt").read_text().split()]
        assert len(seen) == 4
        assert f"Sliding gave this rank 4 validation indices [{', '.join(map(str, seen))}]" in out, out[-4000:]


def test_a_loader_of_its_own_is_not_judged_naming_its_type_line_and_what_to_do(fake_runs):
    """mlcolvar's DictLoader: no sampler injected, no fetch to read; the reason names it, not 'no sampler'."""
    built = {"site": {"file": "/pkg/datamodule.py", "line": 168, "func": "DictModule.val_dataloader"},
             "cls": "DictLoader", "torch_loader": False}
    loader = {"indices": None, "dataset_len": 10, "sampler": None, "dataset": "DictDataset", "built": built}
    v = judge(fake_runs.run(values=_values([{"validate": _stage([loader])}] * 2), kind="eval"))
    assert v.outcome == "not_judged"
    assert v.summary == ("not judged: cannot tell samples apart in validation: DictLoader, not a torch DataLoader, "
                         "over DictDataset (no dataset indices to read).")
    assert any("DictLoader (built at /pkg/datamodule.py:168 (DictModule.val_dataloader)) is not a torch DataLoader, "
               "so Lightning injects no DistributedSampler into it" in n for n in v.notes)


def test_a_target_without_evaluation_loaders_is_not_judged(fake_runs):
    # Nothing was evaluated, so nothing was compared: a pass here would be a pass that judged nothing.
    v = judge(fake_runs.run(values=_values([{}, {}], driver=()), kind="eval"))
    assert v.outcome == "not_judged", v.render()
    assert v.summary == ("not judged: the target has no validation, test or predict dataloader, so no evaluation "
                         "ran to count samples in.")


def test_a_failed_verdict_carries_only_the_claims_of_what_it_says(fake_runs):
    """A stage that passed (its "= on 1 device" sentence is left out of a failed verdict) leaves its
    claims out too: every claim's text is in the message (found on a shared case)."""
    ranks = [{"validate": _stage([_loader([0, 2, 4], 5, total=6)], {"val_acc": 0.5}),
              "test": _stage([_loader([0, 2], 4)], {"test_acc": 0.75})},
             {"validate": _stage([_loader([1, 3, 0], 5, total=6)], {"val_acc": 0.5}),
              "test": _stage([_loader([1, 3], 4)], {"test_acc": 0.75})}]
    ref_stages = {"validate": _stage([_loader([0, 1, 2, 3, 4], 5)], {"val_acc": 0.4}),
                  "test": _stage([_loader([0, 1, 2, 3], 4)], {"test_acc": 0.75})}
    ref = fake_runs.run(values=_values([ref_stages], driver=("validate", "test")), kind="eval-reference")
    v = judge(fake_runs.run(values=_values(ranks, driver=("validate", "test")), kind="eval", reference=ref))
    assert v.outcome == "failed", v.render()
    assert "test_acc" not in v.render()
    assert claims.check({"contract": "eval-duplication", **v.as_dict()}) == []


@pytest.mark.parametrize("rank1, single, word", [(float("nan"), float("nan"), "NaN"),
                                                  (float("inf"), float("inf"), "inf"),
                                                  (0.25, float("nan"), "NaN")])
def test_a_metric_that_is_nan_or_inf_is_not_judged_and_named_never_a_failure(fake_runs, rank1, single, word):
    """Trial 19:40 (torch-uncertainty CovAt5Risk): a synced metric NaN on both ranks and on one device
    was failed as "computed from rank 0's shard alone" (NaN vs NaN counted as a difference). A NaN or
    inf compares nothing: the key is named as not judged, the other keys are still compared."""
    log = {"ev": "log", "name": "risk", "hook": "on_test_epoch_end", "rank_zero_only": False,
           "sync_dist": False, "user": True, "site": {"file": "/x/m.py", "line": 42, "func": "f"}}
    ranks = [{"test": _stage([_loader([0, 2], 4)], {"risk": 0.5 if rank1 == 0.25 else rank1, "acc": 0.75})},
             {"test": _stage([_loader([1, 3], 4)], {"risk": rank1, "acc": 0.75})}]
    ref_stages = {"test": _stage([_loader([0, 1, 2, 3], 4)], {"risk": single, "acc": 0.75})}
    ref = fake_runs.run(values=_values([ref_stages], driver=("test",)), kind="eval-reference")
    v = judge(fake_runs.run([[log], []], _values(ranks, driver=("test",)), kind="eval", reference=ref))
    assert v.outcome == "passed", v.render()
    assert "acc 0.75 on 2 ranks = 0.75 on 1 device" in v.summary
    assert f"risk is not judged, because the value is {word} on " in v.summary
    assert "shard alone" not in v.render()
    assert claims.check({"contract": v.contract, **v.as_dict()}) == []


def test_a_duplicate_stage_names_its_nan_metric_as_not_judged(fake_runs):
    """The not-judged key is named on a failed stage too (a note), and is never its evidence."""
    nan = float("nan")
    ranks = [{"validate": _stage([_loader([0, 2, 4], 5, total=6)], {"val_acc": 0.5, "risk": nan})},
             {"validate": _stage([_loader([1, 3, 0], 5, total=6)], {"val_acc": 0.5, "risk": nan})}]
    ref_stages = {"validate": _stage([_loader([0, 1, 2, 3, 4], 5)], {"val_acc": 0.4, "risk": nan})}
    ref = fake_runs.run(values=_values([ref_stages]), kind="eval-reference")
    v = judge(fake_runs.run(values=_values(ranks), kind="eval", reference=ref))
    assert v.outcome == "failed", v.render()
    assert any("risk is not judged, because the value is NaN on 2 ranks and on 1 device" in n for n in v.notes)
    assert not any("risk" in e.detail for e in v.evidence)
    assert claims.check({"contract": "eval-duplication", **v.as_dict()}) == []


def test_the_not_finite_claim_fails_a_sentence_over_finite_values():
    said = "x is not judged, because the value is NaN on 2 ranks"
    bad = {"contract": "eval-duplication", "outcome": "passed", "message": said,
           "claims": [{"kind": "not-finite", "text": said,
                       "facts": {"values": {"rank 0": 0.5, "rank 1": 0.5}}}]}
    assert claims.check(bad)
    bad["claims"][0]["facts"]["values"] = {"rank 0": "nan", "rank 1": "nan"}
    assert claims.check(bad) == []
