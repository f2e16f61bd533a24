"""configure-model verdicts over hand-made rank observations (no worlds: the end-to-end runs are in
test_sharded.py and the corpus)."""

from __future__ import annotations

from pytest_ltconform.contracts import get_contract


def observed(**overrides) -> dict:
    data = {"class_name": "Model", "user_sharded": None, "user_strategy": None, "zero_stage": None,
            "run_sharded": False, "init_numel": 66, "init_bytes": 264, "init_meta_numel": 0,
            "init_dtypes": ["float32"], "init_groups": {"layer": 66}, "overrides_configure_model": False,
            "configure_model_site": None, "sharded_override_site": None, "calls": [],
            "eval": {"stage": "validate", "fit_metrics": {"val_loss": 1.0}, "eval_metrics": {"val_loss": 1.0},
                     "weights": {"replaced": {}, "changed": {}}}}
    data.update(overrides)
    return data


def call(stage: str, replaced=None, changed=None, created=0) -> dict:
    return {"stage": stage, "replaced": replaced or {}, "changed": changed or {}, "removed": [],
            "created_numel": created, "created_bytes": created * 4, "params_before": 0, "params_after": 0}


def judge(fake_runs, **overrides):
    """The verdict on a 2-rank run in which both ranks observed ``observed(**overrides)``."""
    data = observed(**overrides)
    return get_contract("configure-model").judge(fake_runs.probed("configure-model", [data, data]))


def test_second_call_replacing_parameters_fails_with_values(fake_runs):
    v = judge(fake_runs, overrides_configure_model=True, configure_model_site="m.py:10",
              calls=[call("fit", created=146),
                     call("validate", replaced={"body": {"n": 4, "of": 4, "before": 0.18, "after": -2.35}})],
              eval={"stage": "validate", "fit_metrics": {"val_loss": 3.75}, "eval_metrics": {"val_loss": 11.97},
                    "weights": {"replaced": {"body": {"n": 4, "of": 4, "before": 0.18, "after": -2.35}}}})
    assert v.outcome == "failed" and v.category == "silent"
    assert "configure_model called 2 times (fit, then validate) replaced every parameter of body" in v.summary
    assert "validate's val_loss 11.97 vs 3.75 at the end of fit" in v.summary
    assert "return early" in v.fix


def test_in_place_reinitialisation_fails(fake_runs):
    v = judge(fake_runs, overrides_configure_model=True,
              calls=[call("fit", created=10),
                     call("validate", changed={"head": {"n": 1, "of": 2, "before": 1.0, "after": 0.5}})])
    assert v.outcome == "failed" and "changed the values of 1 of 2 parameters of head" in v.summary


def test_large_init_fails_only_when_the_user_config_is_sharded(fake_runs):
    big = {"init_numel": 1_050_624, "init_bytes": 4_202_496, "init_groups": {"trunk": 1_050_624}}
    v = judge(fake_runs, user_sharded="deepspeed", user_strategy="DeepSpeedStrategy(stage=3)", zero_stage=3,
              run_sharded=True, **big)
    assert v.outcome == "failed"
    assert "1,050,624 parameters (4.0 MiB fp32) created in Model.__init__ and none in configure_model " \
           "(not overridden) under DeepSpeedStrategy(stage=3)" in v.summary
    assert "self.trunk is not None" in v.fix
    # The same model under a DDP config, measured on the CPU FSDP tier: reported, not failed.
    v = judge(fake_runs, run_sharded=True, **big)
    assert v.outcome == "passed" and "4.0 MiB" in v.summary and "names no sharded strategy" in v.summary
    # A small model under a sharded config passes with the measurement.
    v = judge(fake_runs, user_sharded="fsdp", user_strategy="FSDPStrategy()", run_sharded=True)
    assert v.outcome == "passed" and "66 parameters (264 B fp32)" in v.summary


def test_configure_sharded_model_override_fails_with_site(fake_runs):
    v = judge(fake_runs, sharded_override_site="m.py:30")
    assert v.outcome == "failed" and "configure_sharded_model is overridden" in v.summary
    assert v.evidence[0].site == "m.py:30" and "configure_model" in v.fix


def test_a_copy_holding_the_trained_values_is_not_lost():
    """rl4co's setup() deep-copies the policy into ``baseline`` on every stage: new tensor objects,
    the trained values; only a parameter whose values differ is lost (field26 item 8)."""
    import copy

    import torch

    from pytest_ltconform.contracts.configure_model.probe import _compare, _params

    model = torch.nn.Module()
    model.policy = torch.nn.Linear(3, 2)
    model.baseline = copy.deepcopy(model.policy)
    trained = _params(model)
    # The replaced layers stay referenced: a freed tensor's id() can be reused by a new one, which
    # would read as "changed in place" instead of "replaced" (both are lost weights).
    kept_alive = [model.baseline]
    model.baseline = copy.deepcopy(model.policy)
    kept = _compare(trained, _params(model))
    assert (kept["replaced"], kept["changed"]) == ({}, {})
    kept_alive.append(model.baseline)
    model.baseline = torch.nn.Linear(3, 2)  # re-initialised: other values
    lost = _compare(trained, _params(model))
    assert lost["replaced"]["baseline"]["n"] == 2 and lost["changed"] == {}, lost
    with torch.no_grad():
        model.policy.weight.add_(1.0)
    assert _compare(trained, _params(model))["changed"]["policy"]["n"] == 1


def test_evidence_never_shows_equal_checksums_as_a_difference(fake_runs):
    close = {"n": 1, "of": 2, "before": 59.82231, "after": 59.82234, "moved": 3e-5}
    swapped = {"n": 2, "of": 2, "before": 1.5, "after": 1.5, "moved": 2.0}
    v = judge(fake_runs, eval={"stage": "validate", "fit_metrics": {}, "eval_metrics": {},
                               "weights": {"replaced": {"head": close}, "changed": {"body": swapped}}})
    assert v.outcome == "failed"
    texts = [e.detail for e in v.evidence]
    assert "head: 1 of 2 parameters hold other values after validate than at the end of fit " \
           "(checksum 59.822310 -> 59.822340)" in texts
    assert "body: 2 of 2 parameters hold other values after validate than at the end of fit (group checksum " \
           "1.5000 on both sides, per-tensor checksums moved by 2 in all)" in texts


SETUP_COPIES_THE_POLICY = '''
import copy

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.policy = torch.nn.Linear(4, 1)
        self.baseline = copy.deepcopy(self.policy)

    def setup(self, stage):
        # A rollout baseline (rl4co): a fresh copy of the current policy on every stage, and after
        # every training epoch, so at the end of fit it holds the trained values.
        self.baseline = copy.deepcopy(self.policy).requires_grad_(False)

    def on_train_epoch_end(self):
        self.setup("fit")

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.policy(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.policy(x), y), sync_dist=True, batch_size=len(y))

    def train_dataloader(self):
        return DataLoader(_data(32, 1), batch_size=4)

    def val_dataloader(self):
        return DataLoader(_data(16, 2), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.policy.parameters(), lr=0.1)
'''


def test_a_hook_that_copies_trained_weights_passes_end_to_end(pytester, no_leftover_ranks):
    """setup() deep-copies the trained policy for validate: new tensor objects with the trained
    values are not lost weights (field26 rl4co: a false FAILED showing 59.8223 -> 59.8223)."""
    pytester.makepyfile(copies=SETUP_COPIES_THE_POLICY)
    result = pytester.runpytest_subprocess("--ltconform", "copies.py:Model", "--ltconform-strategies", "ddp",
                                           "-k", "configure", "-p", "no:cacheprovider", "-rA")
    result.stdout.fnmatch_lines(["*PASSED ltconform::copies.py:Model::configure-model[[]ddp[]]*"])
    result.stdout.fnmatch_lines(["*validate after fit used the trained weights*"])


def test_a_nan_parameter_is_not_judged_never_lost_weights(fake_runs):
    """Trial 19:40's kind in configure-model: a parameter whose checksum is NaN before and after a
    call (nan != nan) was counted as "changed the values of", a false lost-weights failure. It is
    named as not judged; the other parameters are still compared."""
    import torch

    from pytest_ltconform import claims
    from pytest_ltconform.contracts.configure_model.probe import _compare, _params

    model = torch.nn.Module()
    model.policy = torch.nn.Linear(3, 2)
    model.unused = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.unused.weight.fill_(float("nan"))
    trained = _params(model)
    seen = _compare(trained, _params(model))
    assert (seen["replaced"], seen["changed"]) == ({}, {}), seen
    assert [n for n, *_ in seen["not_finite"]] == ["unused.weight"]
    v = judge(fake_runs, overrides_configure_model=True, calls=[call("fit"), {**call("validate"), **seen}])
    assert v.outcome == "passed", v.render()
    assert any("parameter unused.weight not judged, because the value is NaN on rank 0" in n for n in v.notes)
    assert claims.check({"contract": "configure-model", **v.as_dict()}) == []
