"""The CPU deepspeed tier: real DeepSpeed ZeRO on 2 gloo ranks, through the plugin.

Units (no world): the CPU substitutions of a DeepSpeed config. End to end (one pytest subprocess each, a
few tens of seconds): a conforming ZeRO-3 module passes every deepspeed item, and a rank-0-only save
under ZeRO-3 deadlocks for real and fails all-rank-save[deepspeed] with the user's line.
"""

from __future__ import annotations

import pytest
from conftest import CONFORMANCE

from pytest_ltconform import sharded

pytest_plugins = ["pytester"]

needs_deepspeed = pytest.mark.skipif(not sharded.deepspeed_installed(),
                                     reason="deepspeed not installed (pip install 'pytest-ltconform[deepspeed]')")

ZERO3_OK = CONFORMANCE / "configure-model" / "ok_deepspeed_zero3_configure_model.py"
ZERO3_RANK0_SAVE = CONFORMANCE / "all-rank-save" / "deepspeed_zero3_save_on_rank_zero.py"


def test_cpu_config_substitutes_what_cpu_cannot_run_and_says_so():
    config = {"optimizer": {"type": "Adam", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"},
                                    "offload_param": {"device": "cpu"}},
              "fp16": {"enabled": True}, "bf16": {"enabled": False}}
    out, done = sharded.cpu_deepspeed_config(config)
    assert out == {"optimizer": {"type": "Adam", "params": {"lr": 0.1, "torch_adam": True}},
                   "zero_optimization": {"stage": 3}}
    assert config["fp16"] == {"enabled": True}  # the user's dict is not touched
    assert done == ["the config's Adam optimizer runs as torch.optim.Adam (DeepSpeed's FusedAdam/CPUAdam need "
                    "compiled ops)",
                    "offload_optimizer and offload_param dropped (no offload: the partitioned state stays in rank "
                    "memory)",
                    "fp16 dropped (fp32)"]
    lamb, done = sharded.cpu_deepspeed_config({"optimizer": {"type": "Lamb", "params": {"lr": 0.2, "x": 1}}})
    assert lamb["optimizer"] == {"type": "AdamW", "params": {"lr": 0.2, "torch_adam": True}}
    assert "Lamb optimizer runs as torch.optim.AdamW" in done[0]
    assert sharded.cpu_deepspeed_config({"zero_optimization": {"stage": 2}}) == ({"zero_optimization": {"stage": 2}},
                                                                                 [])


def test_configured_for_each_item_strategy():
    assert sharded.configured_for("deepspeed", "deepspeed_stage_3") is True
    assert sharded.configured_for("deepspeed", "fsdp") is False
    assert sharded.configured_for("fsdp", "deepspeed_stage_2") is True  # the fsdp item runs DeepSpeed configs too
    assert sharded.configured_for("deepspeed", None) is False and sharded.configured_for("ddp", None) is True


def _run(pytester, case, *extra):
    pytester.syspathinsert(case.parent)
    return pytester.runpytest_subprocess(
        "--ltconform", f"{case}:Model", "--ltconform-trainer", f"{case}:trainer_kwargs",
        "--ltconform-strategies", "deepspeed", "-m", "ltconform_cpu", "--ltconform-timeout", "60",
        "-p", "no:cacheprovider", "-rA", *extra)


@needs_deepspeed
def test_conforming_zero3_module_passes_every_deepspeed_item(pytester):
    result = _run(pytester, ZERO3_OK)
    out = result.stdout.str()
    assert result.ret == 0, out[-4000:]
    assert result.parseoutcomes().get("passed") == 5, out[-4000:]
    for cid in ("all-rank-save", "sync-dist", "configure-model", "data-sharding", "shared-writes"):
        assert f"PASSED ltconform::{ZERO3_OK}:Model::{cid}[deepspeed]" in out


@needs_deepspeed
def test_rank_zero_save_under_zero3_deadlocks_and_fails_with_the_users_line(pytester):
    result = _run(pytester, ZERO3_RANK0_SAVE, "-k", "all-rank-save[")
    out = result.stdout.str()
    assert result.parseoutcomes().get("failed") == 1, out[-4000:]
    assert "Trainer.save_checkpoint called on rank 0 only" in out, out[-4000:]
    assert "deepspeed_zero3_save_on_rank_zero.py:31 (RankZeroSnapshot.on_train_epoch_end)" in out
    assert "under DeepSpeed the save is itself a collective" in out
    assert "The world did not finish" in out


def test_half_precision_runs_fp32_under_the_cpu_deepspeed_tier_and_says_so():
    class Strategy:
        ltconform_fp32 = True

    assert sharded.precision_note(Strategy(), "16-mixed") == (
        "Trainer(precision='16-mixed') ran as precision='32-true' (DeepSpeed half precision needs a GPU).")
    assert sharded.precision_note(Strategy(), "32-true") is None and sharded.precision_note(object(), "bf16") is None
