"""strategy-config: the rank-side findings on real strategy objects and config files, and the
verdict on them (judged from the config alone: no world needed)."""

from __future__ import annotations

import types

import pytest

from pytest_ltconform.contracts import get_contract


def test_strategy_config_deepspeed_findings(tmp_path, fake_runs):
    from pytest_ltconform.contracts.strategy_config import probe as sc

    cfg = tmp_path / "cfg.py"
    cfg.write_text('DS = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2}\n')
    strategy = types.SimpleNamespace(config={
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2,
        "zero_optimization": {"reduce_bucket_size": "5e8",
                              "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "missing")}},
        "bf16": {"enabled": True}})
    facts = sc._deepspeed_facts(strategy, types.SimpleNamespace(), {"precision": "32-true"}, str(cfg))
    kinds = {f["kind"] for f in facts}
    assert kinds == {"ds_auto", "ds_non_numeric", "ds_accumulation", "ds_precision", "ds_offload_path"}
    auto = next(f for f in facts if f["kind"] == "ds_auto")
    assert auto["site"]["line"] == 1
    facts_seen = {"strategy": "DeepSpeedStrategy", "precision": "32-true", "accumulate": 1, "findings": facts}
    run = fake_runs.run(values=[{"probes": {"strategy-config": facts_seen}}])
    verdict = get_contract("strategy-config").judge(run)
    assert verdict.outcome == "failed" and '"auto" at train_micro_batch_size_per_gpu' in verdict.summary


def test_strategy_config_nccl_timeout(monkeypatch):
    from datetime import timedelta

    from pytest_ltconform.contracts.strategy_config import probe as sc

    monkeypatch.setenv("NCCL_TIMEOUT", "7200")
    default = types.SimpleNamespace(_timeout=timedelta(minutes=30))
    explicit = types.SimpleNamespace(_timeout=timedelta(minutes=5))
    assert sc._timeout_facts(default, {}, None, None)[0]["explicit"] is False
    assert sc._timeout_facts(explicit, {}, None, None)[0]["explicit"] is True
    assert sc._timeout_facts("ddp", {}, None, None)[0]["explicit"] is False


def test_strategy_config_policy_classes():
    import functools

    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy
    from torch.nn import Linear, TransformerEncoderLayer

    from pytest_ltconform.contracts.strategy_config.probe import _policy_classes

    assert _policy_classes(ModuleWrapPolicy({Linear})) == [Linear]
    partial = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerEncoderLayer})
    assert _policy_classes(partial) == [TransformerEncoderLayer]


def _zero_findings(tmp_path, config: dict, source: str) -> list[dict]:
    from pytest_ltconform.contracts.strategy_config import probe as sc

    cfg = tmp_path / "cfg.py"
    cfg.write_text(source)
    facts = sc._deepspeed_facts(types.SimpleNamespace(config=config), types.SimpleNamespace(), {}, str(cfg))
    return [f for f in facts if f["kind"] == "ds_zero_key_outside"]


def test_strategy_config_offload_block_outside_zero_section(tmp_path, fake_runs):
    config = {"zero_optimization": {"stage": 2}, "offload_optimizer": {"device": "cpu"}}
    source = 'DS = {\n    "zero_optimization": {"stage": 2},\n    "offload_optimizer": {"device": "cpu"},\n}\n'
    found = _zero_findings(tmp_path, config, source)
    assert [(f["key"], f["site"]["line"]) for f in found] == [("offload_optimizer", 3)]
    facts_seen = {"strategy": "DeepSpeedStrategy", "precision": "32-true", "accumulate": 1, "findings": found}
    verdict = get_contract("strategy-config").judge(fake_runs.run(values=[{"probes": {"strategy-config": facts_seen}}]))
    assert verdict.outcome == "failed"
    assert 'key "offload_optimizer" is at the top level' in verdict.summary
    assert "stage 2) has no offload_optimizer" in verdict.summary and "no optimizer offload" in verdict.summary
    assert 'move "offload_optimizer" into the "zero_optimization" section' in verdict.fix


def test_strategy_config_stage_outside_zero_section_means_zero_off(tmp_path):
    """A variant: the stage itself written beside the section runs ZeRO stage 0."""
    config = {"stage": 3, "stage3_max_live_parameters": 1e8, "zero_optimization": {"overlap_comm": True}}
    found = _zero_findings(tmp_path, config, "DS = {'stage': 3, 'stage3_max_live_parameters': 1e8}\n")
    assert [f["key"] for f in found] == ["stage", "stage3_max_live_parameters"]
    assert "0 (ZeRO disabled)" in found[0]["in_effect"]


def test_strategy_config_zero_keys_inside_their_section_pass(tmp_path):
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
              "train_micro_batch_size_per_gpu": 4, "zero_allow_untested_optimizer": True}
    assert _zero_findings(tmp_path, config, "DS = {}\n") == []


def test_lightning_rejecting_the_deepspeed_config_is_a_config_failure():
    """Lightning's own check of the DeepSpeed dict (accumulation in the config) stops the fit before
    DeepSpeed sees it: strategy-config claims that stop, so its other items are not judged."""
    from pytest_ltconform.contracts.strategy_config import deepspeed_config_raise

    site = "/venv/lib/python3.11/site-packages/lightning/pytorch"
    tb = (f'Traceback (most recent call last):\n  File "{site}/trainer/trainer.py", line 584, in fit\n'
          f'  File "{site}/strategies/deepspeed.py", line 325, in setup_environment\n'
          f'  File "{site}/strategies/deepspeed.py", line 924, in _format_batch_size_and_grad_accum_config\n'
          "lightning.fabric.utilities.exceptions.MisconfigurationException: Do not set `gradient_accumulation_steps`")
    assert deepspeed_config_raise(tb)
    checkpoint = tb.replace("_format_batch_size_and_grad_accum_config", "load_checkpoint")
    assert not deepspeed_config_raise(checkpoint)  # not a config check: the user's checkpoint


def test_deepspeed_auto_values_say_what_deepspeed_makes_of_each(fake_runs):
    """Issue 38 §4: "auto" at gradient_clipping and fp16.enabled was explained with the micro-batch size
    and bucket defaults. DeepSpeed's own config reader says what happens to each key."""
    pytest.importorskip("deepspeed")
    from pytest_ltconform.contracts.strategy_config import probe as sc

    strategy = types.SimpleNamespace(config={"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
                                             "train_micro_batch_size_per_gpu": 4, "gradient_clipping": "auto",
                                             "fp16": {"enabled": "auto"}})
    loaded = types.SimpleNamespace(datamodule=None, model=types.SimpleNamespace(train_dataloader=lambda: None))
    facts = sc._deepspeed_facts(strategy, types.SimpleNamespace(), {"precision": "32-true"}, None)
    assert not any(f["kind"] == "ds_precision" for f in facts)  # "auto" enables nothing
    sc._auto_effects(facts, strategy, loaded, {}, 2)
    auto = next(f for f in facts if f["kind"] == "ds_auto")
    assert auto["effects"]["gradient_clipping"]["effect"] == "kept"
    assert auto["effects"]["fp16.enabled"] == {"effect": "default", "value": "False"}
    assert auto["effects"]["zero_optimization.reduce_bucket_size"] == {"effect": "default", "value": "500000000"}
    seen = {"strategy": "DeepSpeedStrategy", "precision": "32-true", "accumulate": 1, "findings": facts}
    verdict = get_contract("strategy-config").judge(fake_runs.run(values=[{"probes": {"strategy-config": seen}}]))
    assert verdict.outcome == "failed"
    assert 'gradient_clipping: DeepSpeed keeps the string "auto", and its engine compares it with 0.0 before every ' \
           "optimizer step (`gradient_clipping() > 0.0`): a TypeError at the first step" in verdict.summary
    assert "fp16.enabled: DeepSpeed replaces it by its default, False" in verdict.summary
    assert "micro-batch" not in verdict.summary
    from pytest_ltconform import claims

    assert claims.check({"contract": verdict.contract, **verdict.as_dict()}) == []


def test_a_deepspeed_fit_stopped_by_an_auto_value_is_this_contracts(fake_runs):
    """Issue 38 §4: the fit under DeepSpeed raised TypeError at `gradient_clipping() > 0.0` on every
    rank; strategy-config, which explains the "auto" value, claims that stop (one fault, one item)."""
    from pytest_ltconform.contracts.strategy_config import stopped_on_auto
    from pytest_ltconform.contracts.strategy_config.probe import DS_AUTO

    tb = ('Traceback (most recent call last):\n  File "/site/deepspeed/runtime/engine.py", line 3506, in '
          '_take_model_step\n    if self.gradient_clipping() > 0.0:\n'
          "TypeError: '>' not supported between instances of 'str' and 'float'\n")
    ranks = [fake_runs.rank(r, [DS_AUTO.new(paths=["gradient_clipping"])], status="error", exc_type="TypeError",
                            message="'>' not supported between instances of 'str' and 'float'", traceback=tb)
             for r in (0, 1)]
    run = fake_runs.of(ranks, status="error")
    run.strategy = "deepspeed"
    assert stopped_on_auto(run) == {"what": "TypeError: '>' not supported between instances of 'str' and 'float'",
                                    "ranks": "every rank", "where": "deepspeed/runtime/engine.py:3506"}
    assert get_contract("strategy-config").blames(run) is not None
    other = fake_runs.of([fake_runs.rank(r, [DS_AUTO.new(paths=["gradient_clipping"])], status="error",
                                         exc_type="RuntimeError", message="ZeRO-3 broke", traceback=tb)
                          for r in (0, 1)], status="error")
    other.strategy = "deepspeed"
    assert stopped_on_auto(other) is None  # not what a string "auto" raises: not claimed


@pytest.mark.parametrize("zero", [
    {"stage": 2, "offload_optimizer": True, "overlap_comm": True},   # Lightning-AI/pytorch-lightning#17790
    {"stage": 3, "offload_param": True},
    {"stage": 3, "offload_param": {"device": "gpu"}},
])
def test_deepspeed_validates_the_config_as_written_not_the_cpu_copy(tmp_path, zero, fake_runs):
    """Field trial (deepspeed_offload_optimizer_as_bool): the CPU tier drops the offload sections, so
    validating its copy passed a config DeepSpeed refuses at engine init on the GPUs; the check
    validates the config the user wrote."""
    pytest.importorskip("deepspeed")
    from pytest_ltconform.contracts.strategy_config import probe as sc

    cfg = tmp_path / "cfg.py"
    cfg.write_text(f"config = {{'zero_optimization': {zero!r}}}\n")
    strategy = types.SimpleNamespace(config={"zero_optimization": dict(zero)})
    loaded = types.SimpleNamespace(datamodule=None, model=types.SimpleNamespace())
    found = sc._ds_rejected(strategy, loaded, {}, str(cfg), 2)
    assert [f["kind"] for f in found] == ["ds_rejected"], found
    key = next(k for k in ("offload_optimizer", "offload_param") if k in zero)
    assert key in found[0]["detail"], found
    assert strategy.config == {"zero_optimization": zero}  # the user's dict is left as it was
    facts = {"strategy": "DeepSpeedStrategy", "kind": "deepspeed", "precision": "32-true", "accumulate": 1,
             "findings": found}
    run = fake_runs.run(values=[{"probes": {"strategy-config": facts}}])
    run.strategy = "deepspeed"
    verdict = get_contract("strategy-config").judge(run)
    assert verdict.outcome == "failed" and "refuses the config as written" in verdict.summary
    assert verdict.rule_section == "DeepSpeed"


def test_the_pass_cites_the_section_of_the_strategy_it_judged(fake_runs):
    def judged(kind, strategy):
        facts = {"strategy": "X", "kind": kind, "precision": "32-true", "accumulate": 1, "findings": []}
        run = fake_runs.run(values=[{"probes": {"strategy-config": facts}}])
        run.strategy = strategy
        return get_contract("strategy-config").judge(run)

    ds_ddp, ds_item = judged("deepspeed", "ddp"), judged("deepspeed", "deepspeed")
    assert ds_ddp.outcome == ds_item.outcome == "passed"
    assert ds_ddp.rule_section == ds_item.rule_section == "DeepSpeed"
    assert "judges the config in strategy-config[deepspeed]" in ds_ddp.summary
    assert "DeepSpeed's own config class accepts the config as written" in ds_item.summary
    assert judged("fsdp", "ddp").rule_section == "FSDP"
    plain = judged(None, "ddp")
    assert plain.rule_section == "Choose using measured memory" and "DeepSpeed" not in plain.summary
