"""strategy-config: the rank-side findings on real strategy objects and config files, and the
verdict on them (judged from the config alone: no world needed)."""

from __future__ import annotations

import types

from pytest_ltconform.contracts import get_contract


def test_strategy_config_deepspeed_findings(tmp_path, fake_runs):
    from pytest_ltconform.contracts import strategy_config as sc

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

    from pytest_ltconform.contracts import strategy_config as sc

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

    from pytest_ltconform.contracts.strategy_config import _policy_classes

    assert _policy_classes(ModuleWrapPolicy({Linear})) == [Linear]
    partial = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerEncoderLayer})
    assert _policy_classes(partial) == [TransformerEncoderLayer]
