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
