"""effective-batch: the merge of micro-batches and the report, and the verdict on hand-made gradient
norms against a reference run (no world started)."""

from __future__ import annotations

import pytest

from pytest_ltconform.contracts import get_contract


def test_concat_and_report():
    import torch

    from pytest_ltconform.contracts.effective_batch import EffectiveBatch
    from pytest_ltconform.contracts.effective_batch.window import concat as _concat

    out = _concat([(torch.zeros(2, 3), {"m": torch.ones(2)}), (torch.ones(4, 3), {"m": torch.zeros(4)})])
    assert out[0].shape == (6, 3) and out[1]["m"].shape == (6,)
    loader = {"batches": 5, "samples": 18, "batch_size": 4, "drop_last": False}
    report, notes = EffectiveBatch._report([{"loader": loader}, {"loader": loader}], 4, 2, 2)
    assert "Effective batch 16 = 4 (per rank) x 2 (ranks) x 2 (accumulation)" in report
    assert any("partial final window" in n for n in notes) and any("uneven last batch" in n for n in notes)


@pytest.mark.parametrize("ratio,passed", [(1.0, True), (0.5, False), (1.3, False)])
def test_effective_batch_ratio(ratio, passed, fake_runs):
    values = [{"ebatch": {"sizes": [4], "accumulate": 1, "stepped": True, "loader": {}, "loss_lines": []}}] * 2
    run = fake_runs.run(values=values)
    ref = fake_runs.run(values=[{"reference": {"norm": 2.0, "world_norm": 2.0 * ratio, "cosine": 1.0,
                                               "stepped": True, "per_param": []}}])
    run.reference = ref
    verdict = get_contract("effective-batch").judge(run)
    assert (verdict.outcome == "passed") is passed
    if ratio == 0.5:
        assert "shrinks by the world size" in verdict.summary


def _info(**extra):
    info = {"sizes": [4], "items": [4], "accumulate": 1, "stepped": True, "loader": {}, "loss_lines": [],
            "grad_sig": [("lin.weight", 1.0), ("lin.bias", 0.5)]}
    info.update(extra)
    return info


def _judge(fake_runs, infos, ref):
    run = fake_runs.run(values=[{"ebatch": i} for i in infos])
    run.reference = fake_runs.run(values=[{"reference": ref}])
    return get_contract("effective-batch").judge(run)


_REF = {"norm": 2.0, "world_norm": 2.0, "cosine": 1.0, "stepped": True, "per_param": [], "repeat_diff": 0.0}


_SITE = {"file": "/x/model.py", "line": 40, "func": "Model.training_step"}


@pytest.mark.parametrize("kind, cause, fix", [
    ("plain", "at /x/model.py:40 (Model.training_step) is a plain loss.backward(), not run by the strategy",
     "call self.manual_backward(loss) instead of loss.backward()"),
    ("no_sync", "at /x/model.py:40 (Model.training_step) ran with DDP's gradient sync off (no_sync)",
     "outside no_sync"),
    ("synced", "no recorded backward explains it", "do not change the gradients per rank")])
def test_ranks_stepping_on_different_gradients_fail_with_the_backward_that_bypassed_the_all_reduce(
        fake_runs, kind, cause, fix):
    last = {"kind": kind, "site": _SITE}
    other = _info(grad_sig=[("lin.weight", 1.3), ("lin.bias", 0.5)], last_backward=last)
    verdict = _judge(fake_runs, [_info(last_backward=last), other], {**_REF, "world_norm": 1.0})
    assert verdict.outcome == "failed" and verdict.category == "silent"
    assert verdict.summary.startswith("the ranks stepped on different gradients at the first optimizer step "
                                      "(parameter lin.weight has gradient norm 1 on rank 0 and 1.3 on rank 1)")
    assert cause in verdict.summary and fix in verdict.fix
    norms = [(e.rank, e.detail) for e in verdict.evidence if e.rank is not None]
    assert norms == [(0, "gradient norm 1.11803 at the first optimizer step"),
                     (1, "gradient norm 1.39284 at the first optimizer step")]
    assert any(e.site == "/x/model.py:40 (Model.training_step)" for e in verdict.evidence) is (kind != "synced")


def test_ranks_with_the_same_gradient_are_compared_with_the_reference(fake_runs):
    last = {"kind": "synced", "site": _SITE}
    verdict = _judge(fake_runs, [_info(last_backward=last), _info(last_backward=last)], _REF)
    assert verdict.outcome == "passed", verdict.summary


def test_random_draws_in_the_step_are_not_judged_and_named(fake_runs):
    ref = {**_REF, "world_norm": 1.0, "repeat_diff": 0.2,
           "draws": [{"file": "/x/model.py", "line": 12, "func": "Model.training_step", "what": "torch.randint"}]}
    verdict = _judge(fake_runs, [_info(), _info()], ref)
    assert verdict.outcome == "not_judged"
    assert "random draws inside the step (torch.randint at /x/model.py:12 (Model.training_step))" in verdict.summary
    assert "\n" not in verdict.summary


def test_unmergeable_batches_are_not_judged(fake_runs):
    info = _info(merge_note="the user's collate_fn could not build one batch")
    verdict = _judge(fake_runs, [info, _info()],
                     {"not_judged": "tensors of different trailing shapes (padded to each batch's own length)",
                      "stepped": False})
    assert verdict.outcome == "not_judged"
    assert "cannot be merged into one batch" in verdict.summary and "trailing shapes" in verdict.summary


def _manual(scale, counts=(1, 1), diff=0.0):
    return _info(sizes=[4, 4], items=[4, 4], manual=True, backwards=list(counts), scales=[scale] * len(counts),
                 norm=2.0, sum_norm=2.0, after_backward_diff=diff,
                 backward_site={"file": "/x/model.py", "line": 40, "func": "Model.training_step"})


@pytest.mark.parametrize("scale,outcome", [(1.0, "failed"), (0.5, "passed"), (0.25, "not_judged")])
def test_manual_accumulation_scale(scale, outcome, fake_runs):
    verdict = _judge(fake_runs, [_manual(scale), _manual(scale)], _REF)
    assert verdict.outcome == outcome
    if outcome == "failed":
        assert verdict.summary.startswith("first optimizer step's gradient is 2x the gradient of the mean loss over "
                                          "the same 2 micro-batches x 2 ranks (16 samples)")
        assert "Effective batch 16 = 4 (per rank) x 2 (ranks) x 2 (accumulation)" in verdict.summary
    if outcome == "not_judged":
        assert "scaled by 0.25, not 1/N" in verdict.summary


def test_manual_accumulation_with_hand_rescaled_gradients_is_not_judged(fake_runs):
    verdict = _judge(fake_runs, [_manual(1.0, diff=0.3), _manual(1.0, diff=0.3)], _REF)
    assert verdict.outcome == "not_judged" and "between the last manual_backward and optimizer.step" in verdict.summary


def test_no_step_is_not_judged(fake_runs):
    verdict = _judge(fake_runs, [_info(stepped=False), _info(stepped=False)], _REF)
    assert verdict.outcome == "not_judged" and verdict.not_judged.reason.startswith("no optimizer step")


def test_root_scale_and_concatenable():
    import torch

    from pytest_ltconform.contracts.effective_batch.window import concatenable, root_scale

    w = torch.randn(3, requires_grad=True)
    loss = (w ** 2).mean()
    assert root_scale(loss) == 1.0
    assert root_scale(loss / 2) == 0.5 and root_scale(0.5 * (loss / 4)) == 0.125
    assert root_scale(loss + 0.1 * w.sum()) == 1.0 and root_scale(torch.tensor(1.0)) is None
    assert concatenable([torch.zeros(2, 3), torch.zeros(4, 3)]) is None
    assert "trailing shapes" in concatenable([(torch.zeros(2, 9),), (torch.zeros(2, 7),)])
    assert "SeqBatch" in concatenable([type("SeqBatch", (), {})()] * 2)


def test_merged_by_loader_runs_the_users_collate():
    import torch
    from torch.utils.data import DataLoader

    from pytest_ltconform.contracts.effective_batch.window import merged_by_loader

    data = [torch.full((i + 1,), float(i)) for i in range(8)]

    def pad(items):
        return torch.nn.utils.rnn.pad_sequence(items, batch_first=True)

    loader = DataLoader(data, batch_size=2, collate_fn=pad)
    batches, why = merged_by_loader(loader, [[[0, 1]], [[6, 7]]], 1)
    assert why is None and batches[0].shape == (4, 8) and batches[0][:, 0].tolist() == [0.0, 1.0, 6.0, 7.0]


def test_unmergeable_batches_say_what_was_not_established_and_name_the_sum(fake_runs):
    line = {"file": "/pkg/losses.py", "line": 42, "func": "ContrastiveLoss.forward", "what": "sums over the batch",
            "text": "return loss.sum() * loss_mult"}
    info = _info(merge_note="the dataset returns different samples for the same indices (random draws while loading)",
                 loss_lines=[line])
    verdict = _judge(fake_runs, [info, _info()],
                     {"not_judged": "a batch of type PaddedBatch (not tensors, tuples or dicts of tensors)",
                      "stepped": False})
    assert verdict.outcome == "not_judged", verdict.render()
    assert ("a batch of type PaddedBatch (not tensors, tuples or dicts of tensors); so whether the step's gradient "
            "depends on the world size (a loss summed over the batch rather than averaged) was not established "
            "(unchecked: the loss code sums over the batch: `return loss.sum() * loss_mult` at /pkg/losses.py:42 "
            "(ContrastiveLoss.forward)).") in verdict.summary


def test_loss_lines_read_a_loss_module_that_returns_a_sum():
    import torch

    from pytest_ltconform.contracts.effective_batch.probe import _loss_lines

    class PairLoss(torch.nn.Module):
        def forward(self, a, b):
            loss = (a - b).pow(2)
            return loss.sum() * 1

    class MeanPairLoss(torch.nn.Module):
        def forward(self, a, b):
            return (a - b).pow(2).sum() / len(a)

    class Model(torch.nn.Module):
        def __init__(self, loss):
            super().__init__()
            self._loss = loss

    lines = _loss_lines(Model(PairLoss()))
    assert [(ln["func"], ln["what"], ln["text"]) for ln in lines] == [
        ("test_loss_lines_read_a_loss_module_that_returns_a_sum.<locals>.PairLoss.forward", "sums over the batch",
         "return loss.sum() * 1")]
    assert all(ln["what"].startswith("divides") for ln in _loss_lines(Model(MeanPairLoss())))


def test_batch_and_samples_are_dataset_items_not_tensor_rows(fake_runs):
    # A collated graph batch: 25 atom rows for the 4 molecules each rank's fetch handed the dataset.
    ranks = [_info(sizes=[25], items=[4], item_keys=[0, 1, 2, 3]), _info(sizes=[24], items=[4], item_keys=[4, 5, 6, 7])]
    verdict = _judge(fake_runs, ranks, _REF)
    assert verdict.outcome == "passed"
    assert "Effective batch 8 = 4 (per rank) x 2 (ranks) x 1 (accumulation)" in verdict.summary
    assert "2 ranks x batch 4 vs 2 on 1 rank x batch 8, same 8 samples and weights" in verdict.summary
    assert "25" not in verdict.summary and "49" not in verdict.summary


def test_the_same_samples_on_every_rank_are_counted_once_as_distinct(fake_runs):
    ranks = [_info(sizes=[8], items=[8], item_keys=list(range(8)))] * 2
    verdict = _judge(fake_runs, ranks, _REF)
    assert "same 16 samples (8 distinct: ranks drew the same samples) and weights" in verdict.summary


def test_a_loader_whose_items_cannot_be_counted_says_so_instead_of_rows(fake_runs):
    ranks = [_info(sizes=[8], items=None, loader={"type": "DictLoader", "batch_size": None})] * 2
    verdict = _judge(fake_runs, ranks, _REF)
    assert verdict.outcome == "passed"
    assert "Effective batch not counted: the dataset items in a batch of DictLoader cannot be counted" \
        in verdict.summary
    assert "on 2 ranks vs 2 on 1 rank with the ranks' batches merged, same samples and weights" in verdict.summary
    assert "(per rank)" not in verdict.summary and "batch 8" not in verdict.summary and "16" not in verdict.summary


GRAPHS = '''
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset


class Graphs(Dataset):
    """Each sample is a small graph: 2 or 3 atom rows and one target."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(2 + i % 2, 4, generator=g), torch.randn(1, generator=g)


def collate(samples):
    atoms = torch.cat([a for a, _ in samples])
    owner = torch.cat([torch.full((len(a),), k) for k, (a, _) in enumerate(samples)])
    return atoms, owner, torch.cat([y for _, y in samples])


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        atoms, owner, y = batch
        per_graph = torch.zeros(len(y)).index_add(0, owner, self.layer(atoms).squeeze(-1))
        return (per_graph - y).pow(2).mean()

    def train_dataloader(self):
        return DataLoader(Graphs(), batch_size=4, collate_fn=collate)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
'''


@pytest.mark.slow
def test_a_collated_graph_batch_counts_molecules_not_atom_rows_in_a_real_world(pytester, no_leftover_ranks):
    import json

    pytester.makepyfile(graphs=GRAPHS)
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ltconform", "graphs:Model", "--ltconform-report",
                                  "out.json", "-k", "effective-batch[ and not gpu and not multinode")
    doc = json.loads((pytester.path / "out.json").read_text())
    (result,) = [r for r in doc["results"] if r["contract"] == "effective-batch"]
    assert result["outcome"] == "passed", result["message"]
    assert "Effective batch 8 = 4 (per rank) x 2 (ranks) x 1 (accumulation)" in result["message"]
    assert "x batch 4 vs" in result["message"] and "same 8 samples and weights" in result["message"]


def test_batchnorm_without_running_statistics_is_not_judged(fake_runs):
    coupled = _info(batch_coupled=["BatchNorm1d(track_running_stats=False)"])
    verdict = _judge(fake_runs, [coupled, coupled], {**_REF, "world_norm": 1.0})
    assert verdict.outcome == "not_judged"
    assert verdict.not_judged.reason.startswith("BatchNorm1d(track_running_stats=False) normalises each sample by "
                                      "the statistics of its own batch even in eval mode")


def test_frozen_batch_statistics_and_a_raise_after_the_reference_step_are_noted(fake_runs):
    info = _info(batch_stats_off=["BatchNorm1d"], batch_stats_n=2)
    ref = {**_REF, "after_step": "MisconfigurationException: ModelCheckpoint(monitor='recall@10') could not find"}
    verdict = _judge(fake_runs, [info, info], ref)
    assert verdict.outcome == "passed"
    assert any(n.startswith("2 batch-statistics layer(s) (BatchNorm1d) ran in eval mode") for n in verdict.notes)
    assert any("reference run raised after its step (MisconfigurationException" in n for n in verdict.notes)


def test_a_reference_that_took_no_step_is_named_the_plugins_run_not_the_batch(fake_runs):
    run = fake_runs.run(values=[{"ebatch": _info()}] * 2)
    run.reference = None
    verdict = get_contract("effective-batch").judge(run)
    assert verdict.outcome == "not_judged"
    assert "the plugin's one-rank reference run took no step" in verdict.summary
    assert "a failure of the plugin's own run, not a finding" in verdict.summary


def test_batch_stats_off_freezes_batchnorm_but_not_syncbatchnorm():
    import torch

    from pytest_ltconform.contracts.effective_batch.probe import batch_stats_off

    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.SyncBatchNorm(4),
                              torch.nn.BatchNorm1d(4, track_running_stats=False), torch.nn.InstanceNorm1d(4))
    frozen, coupled = batch_stats_off(net)
    assert frozen == ["BatchNorm1d"] and coupled == ["BatchNorm1d(track_running_stats=False)"]
    assert not net[1].training and net[2].training and net[0].training


def _run_conformance_case(pytester, name: str):
    import json

    from conftest import CONFORMANCE

    source = (CONFORMANCE / "effective-batch" / name).read_text()
    pytester.makepyfile(case_under_test=source)
    args = ["--ltconform", "case_under_test.py:Model", "--ltconform-datamodule", "case_under_test.py:DataModule"]
    if "def trainer_kwargs" in source:
        args += ["--ltconform-trainer", "case_under_test.py:trainer_kwargs"]
    pytester.runpytest_subprocess("-p", "no:cacheprovider", *args, "--ltconform-report", "out.json",
                                  "-k", "effective-batch[ and not gpu and not multinode")
    doc = json.loads((pytester.path / "out.json").read_text())
    (result,) = [r for r in doc["results"] if r["contract"] == "effective-batch"]
    return result


@pytest.mark.slow
def test_a_module_that_changes_its_batch_in_place_is_judged_on_copies(pytester, no_leftover_ranks):
    result = _run_conformance_case(pytester, "ok_batch_changed_in_place_by_forward.py")
    assert result["outcome"] == "passed", result["message"]
    assert "ratio 1, cosine 1.0000" in result["message"]


@pytest.mark.slow
def test_batchnorm_with_a_mean_loss_passes_with_the_layers_in_eval_mode(pytester, no_leftover_ranks):
    result = _run_conformance_case(pytester, "ok_batchnorm_mean_loss.py")
    assert result["outcome"] == "passed", result["message"]
    assert "ratio 1, cosine 1.0000" in result["message"]


@pytest.mark.slow
def test_batchnorm_with_a_sum_loss_still_fails_by_the_world_size(pytester, no_leftover_ranks):
    result = _run_conformance_case(pytester, "batchnorm_sum_loss_under_ddp_average.py")
    assert result["outcome"] == "failed", result["message"]
    assert "(ratio 0.5, cosine 1.0000): the gradient shrinks by the world size (2)" in result["message"]


@pytest.mark.slow
def test_a_metric_logged_at_the_last_validation_batch_does_not_fail_the_reference(pytester, no_leftover_ranks):
    result = _run_conformance_case(pytester, "ok_metric_logged_at_last_validation_batch.py")
    assert result["outcome"] == "passed", result["message"]


def test_norms_within_tolerance_but_gradients_apart_are_not_judged_not_passed(fake_runs):
    """field26 item 5: ts3l's 1st phase passed at ratio 0.957 with the gradients pointing elsewhere."""
    verdict = _judge(fake_runs, [_info(), _info()], {**_REF, "world_norm": 1.914, "cosine": 0.65, "rel_diff": 0.8})
    assert verdict.outcome == "not_judged"
    assert verdict.not_judged.reason.startswith("the world's and the 1-rank gradients differ beyond float32 rounding "
                                      "(relative difference 0.8 > 0.001) but not by a factor")
    assert _judge(fake_runs, [_info(), _info()], {**_REF, "rel_diff": 2e-6}).outcome == "passed"


def test_a_gap_that_half_precision_explains_is_no_coupling(fake_runs):
    """Issue 38 §4: a plain MLP with a mean loss under 16-mixed differed by 0.002 (relative) and was
    told "a loss or layer that couples the samples of a batch": the precision explains the gap."""
    half = {**_REF, "cosine": 1.0, "rel_diff": 0.002}
    verdict = _judge(fake_runs, [_info(precision="16-mixed"), _info(precision="16-mixed")], half)
    assert verdict.outcome == "passed", verdict.render()
    assert any("within what 16-mixed rounding" in n for n in verdict.notes)
    assert _judge(fake_runs, [_info(), _info()], half).outcome == "not_judged"  # float32: still beyond rounding
    far = _judge(fake_runs, [_info(precision="bf16-mixed")] * 2, {**half, "rel_diff": 0.2})
    assert far.outcome == "not_judged" and "beyond bf16-mixed rounding" in far.not_judged.reason
    from pytest_ltconform import claims

    for v in (verdict, far):
        assert claims.check({"contract": v.contract, **v.as_dict()}) == []


def test_no_dropout_also_switches_off_attention_dropout():
    """field26 replay SasRec: nn.MultiheadAttention(dropout=0.2) drew inside the step, so the item was not judged."""
    import torch

    from pytest_ltconform.contracts.effective_batch.probe import _no_dropout

    net = torch.nn.ModuleDict({"att": torch.nn.MultiheadAttention(8, 2, dropout=0.2), "drop": torch.nn.Dropout(0.1)})
    assert _no_dropout(net) == 2
    assert net["att"].dropout == 0.0 and net["drop"].p == 0.0
    x = torch.randn(3, 2, 8)
    torch.manual_seed(1)
    first = net["att"](x, x, x)[0]
    torch.manual_seed(2)
    assert torch.equal(first, net["att"](x, x, x)[0])


def test_only_draws_made_during_a_training_step_are_named():
    # rl4co draws its next epoch's dataset and its baseline rollout in on_train_epoch_end: those
    # draws do not make the step's gradient random, and naming them points the user at the wrong line.
    import torch

    from pytest_ltconform.contracts.effective_batch import window

    in_step = {"on": False}
    found: list = []
    with window.watch_draws(found, active=lambda: in_step["on"]):
        torch.rand(3)  # an epoch-end hook's draw
        in_step["on"] = True
        torch.randint(0, 5, (2,))  # the step's draw
    assert [(d["what"], d["func"]) for d in found] == \
        [("torch.randint", "test_only_draws_made_during_a_training_step_are_named")]


def test_a_loss_module_built_with_reduction_sum_is_named_where_the_step_calls_it():
    # CrossEntropyLoss(reduction=REDUCTION) in __init__: no literal "sum" in the loss code to read.
    import torch

    from pytest_ltconform.contracts.effective_batch.probe import _loss_lines

    class Model(torch.nn.Module):
        def __init__(self, reduction):
            super().__init__()
            self.net = torch.nn.Linear(2, 2)
            self.criterion = torch.nn.CrossEntropyLoss(reduction=reduction)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.criterion(self.net(x), y)

    lines = _loss_lines(Model("sum"))
    assert [(ln["what"], ln["text"]) for ln in lines] == [
        ("self.criterion is CrossEntropyLoss(reduction='sum')", "return self.criterion(self.net(x), y)")]
    assert _loss_lines(Model("mean")) == []


def test_an_odd_factor_with_another_direction_fails_only_with_a_local_count_in_the_loss_code(fake_runs):
    # ts3l's contrastive first phase: ratio 0.904, cosine 0.98, a mean loss over in-batch negatives. A
    # per-rank count normalisation looks the same in one step; only the loss code tells them apart.
    odd = {**_REF, "world_norm": 2.0 * 0.8, "cosine": 0.95}
    coupled = _judge(fake_runs, [_info(), _info()], odd)
    assert coupled.outcome == "not_judged", coupled.render()
    assert coupled.not_judged.reason.startswith("the gradient changes by a factor that is not the world size and "
                                      "its direction differs")
    assert "contrastive loss over in-batch negatives" in coupled.summary
    count = {"file": "/x/model.py", "line": 9, "func": "Model.training_step",
             "what": "divides by a local count (x / mask.sum())", "text": "return (err * mask).sum() / mask.sum()"}
    counted = _judge(fake_runs, [_info(loss_lines=[count]), _info(loss_lines=[count])], odd)
    assert counted.outcome == "failed" and "each rank normalises by its own count" in counted.summary
    # A world-size factor stays a failure whatever the direction or the loss code.
    shrunk = _judge(fake_runs, [_info(), _info()], {**_REF, "world_norm": 1.0, "cosine": 0.95})
    assert shrunk.outcome == "failed" and "shrinks by the world size" in shrunk.summary


@pytest.mark.parametrize("bad", ["ranks", "reference"])
def test_a_nan_gradient_is_not_judged_never_a_difference_or_a_factor(fake_runs, bad):
    """Trial 19:40's kind: a NaN compares nothing. NaN norms on both ranks were "different gradients"
    (isclose(nan, nan) is False); a NaN reference norm gave a "factor nan"."""
    from pytest_ltconform import claims

    nan = float("nan")
    infos = [_info(grad_sig=[("lin.weight", nan), ("lin.bias", 0.5)])] * 2 if bad == "ranks" else [_info()] * 2
    ref = {**_REF, "norm": nan} if bad == "reference" else {**_REF, "world_norm": nan}
    verdict = _judge(fake_runs, infos, ref)
    assert verdict.outcome == "not_judged", verdict.render()
    assert "the first-step gradient is not judged, because the value is NaN on " in verdict.summary
    assert ("rank 0 and on rank 1" in verdict.summary) == (bad == "ranks")
    assert "different gradients" not in verdict.summary and "factor" not in verdict.summary
    assert claims.check({"contract": "effective-batch", **verdict.as_dict()}) == []
