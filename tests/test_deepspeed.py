"""The CPU deepspeed tier: real DeepSpeed ZeRO on 2 gloo ranks, through the plugin.

Units (no world): the CPU substitutions of a DeepSpeed config. End to end (one pytest subprocess each, a
few tens of seconds): a conforming ZeRO-3 module passes every deepspeed item, and a rank-0-only save
under ZeRO-3 deadlocks for real and fails all-rank-save[deepspeed] with the user's line.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import CONFORMANCE, REPO

from pytest_ltconform import sharded

pytest_plugins = ["pytester"]

needs_deepspeed = pytest.mark.skipif(not sharded.deepspeed_installed(),
                                     reason="deepspeed not installed (pip install 'deepspeed>=0.16')")

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
    # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false: its torch path builds AdamW.
    assert done == ["the config's Adam optimizer runs as torch.optim.AdamW (DeepSpeed's FusedAdam/CPUAdam need "
                    "compiled ops)",
                    "offload_optimizer and offload_param dropped (no offload: the partitioned state stays in rank "
                    "memory)",
                    "fp16 dropped (fp32)"]
    lamb, done = sharded.cpu_deepspeed_config({"optimizer": {"type": "Lamb", "params": {"lr": 0.2, "x": 1}}})
    assert lamb["optimizer"] == {"type": "AdamW", "params": {"lr": 0.2, "torch_adam": True}}
    assert done == ["the config's Lamb optimizer runs as torch.optim.AdamW, the nearest torch optimizer, with its lr, "
                    "betas, eps and weight_decay (DeepSpeed's own optimizers need compiled ops)"]
    adam, done = sharded.cpu_deepspeed_config({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}})
    assert adam["optimizer"]["params"] == {"adam_w_mode": False, "torch_adam": True}
    assert done[0].startswith("the config's Adam optimizer runs as torch.optim.Adam (")
    # torch.optim names and Adagrad are built by DeepSpeed as torch's own: nothing to substitute.
    sgd = {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}
    assert sharded.cpu_deepspeed_config(sgd) == (sgd, [])
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
    assert result.parseoutcomes().get("passed") == 7, out[-4000:]  # and the fit[deepspeed] run item
    # strategy-config[deepspeed]: DeepSpeed itself accepted the config as Lightning completes it.
    for cid in ("all-rank-save", "sync-dist", "configure-model", "data-sharding", "shared-writes", "strategy-config"):
        assert f"PASSED ltconform::{ZERO3_OK}:Model::{cid}[deepspeed]" in out
    # -rA prints what ran in place of the user's config in the section of each item judged on the
    # DeepSpeed fit (strategy-config inspects the config in a run of its own).
    passes = out.split("= PASSES =")[1].split("short test summary info")[0]
    assert passes.count("Note: the Trainer config names") == 6, passes[-3000:]  # memory[deepspeed] too
    assert "ran real DeepSpeed ZeRO stage 3 on CPU gloo ranks" in passes, passes[-3000:]


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


# -- DeepSpeed's own config validation, the optimizers a CPU rank cannot build -----------------------

@pytest.fixture
def ds_cpu(monkeypatch):
    """deepspeed imported on its CPU accelerator (as every CPU-tier rank has it)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    return pytest.importorskip("deepspeed")


def test_deepspeed_config_error_is_deepspeeds_own_message_for_the_world_size(ds_cpu):
    batch = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1}
    error = sharded.deepspeed_config_error(batch, world_size=2)
    assert error["type"] == "AssertionError" and error["keys"] == []
    assert error["message"].endswith("32 != 8 * 1 * 2")
    assert sharded.deepspeed_config_error({**batch, "train_batch_size": 16}, world_size=2) is None
    stage = sharded.deepspeed_config_error({**batch, "train_batch_size": 16, "zero_optimization": {"stage": 5}}, 2)
    assert stage["type"] == "ValidationError" and stage["keys"] == ["stage"]
    assert "Input should be 0, 1, 2, 3" in stage["message"] and "errors.pydantic.dev" not in stage["message"]
    assert stage["detail"].startswith("stage: Input should be 0, 1, 2, 3") and stage["detail"].endswith("(got 5)")
    assert error["detail"] == ""
    import deepspeed.comm.comm as ds_comm

    assert ds_comm.cdb is None  # the stand-in backend is gone again


def test_compiled_deepspeed_optimizers_are_built_as_torch_ones_with_the_same_groups(ds_cpu):
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.ops.lamb import FusedLamb

    net = torch.nn.Linear(3, 2)
    groups = [{"params": [net.weight], "weight_decay": 0.05}, {"params": [net.bias], "weight_decay": 0.0}]
    said: list[str] = []
    with sharded.cpu_optimizers(said.append):
        fused = FusedAdam(groups, lr=3e-3, betas=(0.9, 0.95))
        cpu_adam = DeepSpeedCPUAdam(net.parameters(), lr=0.1, adamw_mode=False)
        lamb = FusedLamb(net.parameters(), lr=0.2, weight_decay=0.01)
    assert type(fused) is torch.optim.AdamW  # FusedAdam's adam_w_mode defaults to True
    assert [(g["weight_decay"], g["lr"], g["betas"], g["eps"]) for g in fused.param_groups] == [
        (0.05, 3e-3, (0.9, 0.95), 1e-8), (0.0, 3e-3, (0.9, 0.95), 1e-8)]
    assert fused.param_groups[0]["params"] == [net.weight]
    assert type(cpu_adam) is torch.optim.Adam and cpu_adam.defaults["weight_decay"] == 0
    assert type(lamb) is torch.optim.AdamW and lamb.defaults["lr"] == 0.2
    assert said[0] == ("FusedAdam from configure_optimizers ran as torch.optim.AdamW with the same 2 parameter groups "
                       "(each with its own settings) and lr=0.003, betas=(0.9, 0.95) (DeepSpeed's FusedAdam needs "
                       "kernels compiled on the rank, which the CPU tier does not build)")
    assert said[1].startswith("DeepSpeedCPUAdam from configure_optimizers ran as torch.optim.Adam with the same "
                              "parameters and lr=0.1 (")
    assert "__new__" not in vars(FusedAdam)  # undone on exit


@needs_deepspeed
def test_config_rejection_is_recognised_from_the_rank_traceback():
    import importlib.util
    import os

    from pytest_ltconform.contracts.strategy_config import deepspeed_config_raise

    site = os.path.dirname(os.path.dirname(importlib.util.find_spec("deepspeed").origin))  # the real install
    rejected = (f'Traceback (most recent call last):\n  File "{site}/deepspeed/__init__.py", line 554, in initialize\n'
                f'  File "{site}/deepspeed/runtime/config.py", line 479, in __init__\n'
                f'  File "{site}/pydantic/main.py", line 250, in __init__\nValidationError: 1 validation error')
    assert deepspeed_config_raise(rejected)
    user_after = rejected.replace("pydantic/main.py", "mypkg/hooks.py").replace(site + "/mypkg", "/home/u/mypkg")
    assert not deepspeed_config_raise(user_after)  # the user's own code raised under it
    assert not deepspeed_config_raise(f'  File "{site}/deepspeed/runtime/engine.py", line 1, in step\n')


@needs_deepspeed
def test_deepspeed_cases_end_to_end_in_one_pool(tmp_path):
    """Three cases, five items, one world pool: FusedAdam from configure_optimizers; a config DeepSpeed
    rejects, whose other items are not judged; an FSDP config's sharded checkpoint loaded as a file,
    which the deepspeed item does not judge: the plugin chose DeepSpeed's format, the config saves FSDP's.
    (The corpus judges the third new DeepSpeed case, deepspeed_checkpoint_dir_torch_load, with its evidence
    and fix.)"""
    rejected = CONFORMANCE / "strategy-config" / "deepspeed_train_batch_size_from_other_cluster.py"
    fused = CONFORMANCE / "all-rank-save" / "ok_deepspeed_fused_adam_param_groups.py"
    fsdp_load = CONFORMANCE / "all-rank-save" / "load_sharded_checkpoint_as_file.py"
    items = [f"{fused}:all-rank-save[deepspeed]", f"{rejected}:strategy-config[deepspeed]",
             f"{rejected}:all-rank-save[deepspeed]", f"{rejected}:sync-dist[deepspeed]",
             f"{fsdp_load}:all-rank-save[deepspeed]"]
    out = tmp_path / "items.json"
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "judge_items.py"), str(out), *items], cwd=tmp_path,
                          capture_output=True, text=True, timeout=400)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    got = [(r["item"], r["outcome"]) for r in rows]
    assert got == [("all-rank-save[deepspeed]", "passed"), ("strategy-config[deepspeed]", "failed"),
                   ("all-rank-save[deepspeed]", "not_judged"), ("sync-dist[deepspeed]", "not_judged"),
                   ("all-rank-save[deepspeed]", "skipped")], rows
    ok, config, *skipped, load = rows
    assert any(n.startswith("FusedAdam from configure_optimizers ran as torch.optim.AdamW with the same 2 parameter "
                            "groups (each with its own settings) and lr=0.003, betas=(0.9, 0.95), eps=1e-06")
               for n in ok["notes"]), ok["notes"]
    lines = config["message"].splitlines()
    assert lines[0] == ("[strategy-config] FAILED: DeepSpeed's own config class refuses the config as written, so "
                        "every rank stops inside deepspeed.initialize before the first step: AssertionError: Check "
                        "batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
                        "gradient_acc_step * world_size 32 != 8 * 1 * 2")
    assert lines[2].endswith("deepspeed_train_batch_size_from_other_cluster.py:21 (<module>): DeepSpeed rejected the "
                             "config: train_batch_size 32 is not micro-batch 8 x accumulation 1 x world size 2")
    assert "or set it to 16 for this world" in config["message"]
    for item in skipped:
        assert item["message"].endswith("not judged: the shared fit run stopped before its first step because of "
                                        "the strategy-config[deepspeed] failure (see that item).")
    # The checkpoint this item's run wrote is DeepSpeed's, a format the FSDP config never saves: the plugin's
    # choice, so not judged here (the fsdp item judges the user's fault), with an advisory on the loader.
    first = load["message"].splitlines()[0]
    assert first.startswith("[all-rank-save] skipped: the plugin's DeepSpeed run saved a DeepSpeed checkpoint "
                            "directory (per-rank ZeRO shards) where your config saves an FSDP sharded checkpoint "
                            "directory"), first
    assert "so this item is not judged" in first and "IsADirectoryError" in first
    assert any(n.startswith("advisory: Model.load_from_checkpoint at ") for n in load["notes"]), load["notes"]
