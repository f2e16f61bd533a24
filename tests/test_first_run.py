"""What a first run prints: tiers that cannot run here said once in the header instead of a wall of
skipped items, a run where nothing could be judged said so, the Trainer kwargs the plugin replaces
said once, and live progress lines for long contract runs.

Units need no world. Of the two pytest subprocesses, the first starts no world (every selected
item skips: deepspeed is made unimportable by its conftest); the second starts one 2-rank world for
one traced fit with a slow step.
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import BORING

from pytest_ltconform import harness, progress, tiers, trainer_overrides, vocabulary

pytest_plugins = ["pytester"]

# A conftest that makes `import deepspeed` fail as it does where the package is not installed
# (importlib.util.find_spec answers None for a name whose sys.modules entry is None).
NO_DEEPSPEED = 'import sys\nsys.modules["deepspeed"] = None  # as if deepspeed were not installed\n'

GPU_REASON = "needs 2 CUDA devices, found 0"


def _fn(text: str) -> str:
    """``text`` as a literal fnmatch pattern ([ and ] are pattern characters there)."""
    return re.sub(r"([\[\]])", r"[\1]", text)


DS_REASON = "deepspeed not importable (no module named 'deepspeed'; pip install 'deepspeed>=0.16')"


# -- the -m expression -----------------------------------------------------------------------------

def test_mark_expression_selects_and_names_markers():
    parse = tiers.MarkExpression.parse
    gpu = parse("ltconform_gpu")
    assert gpu.matches({"ltconform", "ltconform_gpu"}) and not gpu.matches({"ltconform", "ltconform_cpu"})
    assert gpu.names("ltconform_gpu") and not gpu.names("ltconform_cpu")

    not_gpu = parse("ltconform and not ltconform_gpu")
    assert not_gpu.matches({"ltconform", "ltconform_cpu"}) and not not_gpu.matches({"ltconform", "ltconform_gpu"})
    assert not_gpu.names("ltconform") and not not_gpu.names("ltconform_gpu")

    # Two negations name a marker; precedence: not > and > or.
    double = parse("not (slow or not ltconform_multinode)")
    assert double.names("ltconform_multinode") and not double.names("slow")
    assert double.matches({"ltconform_multinode"}) and not double.matches({"slow", "ltconform_multinode"})
    mixed = parse("a or b and c")
    assert mixed.matches({"a"}) and not mixed.matches({"b"}) and mixed.matches({"b", "c"})

    everything = parse("")
    assert everything.matches(set()) and not everything.names("ltconform_gpu")
    keyword = parse("ltconform_gpu(serial='x')")  # pytest's keyword match: no generated item has arguments
    assert not keyword.matches({"ltconform_gpu"}) and not keyword.names("ltconform_gpu")
    for bad in ("ltconform_gpu and", "(ltconform_gpu", "a b", "not", "a == b", ")"):
        with pytest.raises(ValueError):
            parse(bad)


# -- which items are hidden ------------------------------------------------------------------------

class _Contract:
    strategies = ("ddp", "fsdp", "deepspeed")


def _decide(markexpr: str = "", require=(), named=(), avail=None) -> dict:
    avail = avail or tiers.Availability(2, cuda_count=lambda: 0, deepspeed_missing=lambda: DS_REASON)
    selected = named or vocabulary.STRATEGIES
    expr = tiers.MarkExpression.parse(markexpr)
    return {v.label: tiers.hidden_reason(v, avail, require, expr, named)
            for v in tiers.variants(_Contract(), selected, vocabulary.CPU_STRATEGIES)}


MULTINODE = ("multinode", "not inside a multi-node world: no torchrun or SLURM launch found in this pytest process "
                          "(run pytest under `torchrun --nnodes N ...` or `srun -N N ...`; see docs/ci.md)")


def test_items_of_tiers_that_cannot_run_are_hidden_unless_asked_for_or_required():
    # A laptop without GPUs or deepspeed, no options: only the CPU items that can run exist.
    assert _decide() == {"ddp": None, "fsdp": None, "deepspeed": ("deepspeed", DS_REASON),
                         "ddp-gpu": ("gpu", GPU_REASON), "fsdp-gpu": ("gpu", GPU_REASON),
                         "deepspeed-gpu": ("deepspeed", DS_REASON), "ddp-multinode": MULTINODE,
                         "fsdp-multinode": MULTINODE}
    # -m ltconform_gpu asks for the gpu tier: its items exist (and skip); deepspeed, not asked, stays
    # hidden; the items -m deselects anyway are not hidden (pytest drops them).
    assert _decide("ltconform_gpu") == {"ddp": None, "fsdp": None, "deepspeed": None, "ddp-gpu": None,
                                        "fsdp-gpu": None, "deepspeed-gpu": ("deepspeed", DS_REASON),
                                        "ddp-multinode": None, "fsdp-multinode": None}
    # A negated marker asks for nothing.
    negated = _decide("ltconform and not ltconform_gpu")
    assert negated["ddp-gpu"] is None and negated["ddp-multinode"] == MULTINODE
    assert negated["deepspeed"] == ("deepspeed", DS_REASON)
    # --ltconform-require: the items exist and fail; deepspeed-gpu needs the required gpu tier too.
    required = _decide(require=("gpu",))
    assert required["ddp-gpu"] is None and required["deepspeed-gpu"] is None
    assert required["ddp-multinode"] == MULTINODE
    # The deepspeed strategy named explicitly asks for the deepspeed tier, not for the gpu tier.
    assert _decide(named=("deepspeed",)) == {"deepspeed": None, "deepspeed-gpu": ("gpu", GPU_REASON)}
    assert _decide("ltconform_deepspeed") == {"ddp": None, "fsdp": None, "deepspeed": None, "ddp-gpu": None,
                                              "fsdp-gpu": None, "deepspeed-gpu": ("gpu", GPU_REASON),
                                              "ddp-multinode": None, "fsdp-multinode": None}
    # Naming ddp asks for no tier: ddp is no tier.
    assert _decide(named=("ddp",)) == {"ddp": None, "ddp-gpu": ("gpu", GPU_REASON), "ddp-multinode": MULTINODE}


def test_inside_a_launched_world_the_multinode_tier_is_decided_after_collection():
    attached = tiers.Attached(launcher="torchrun", environment="TorchElasticEnvironment", rank=0, world_size=4,
                              local_rank=0, node_rank=0, main_address="127.0.0.1", main_port=29500, agent_store=True)
    avail = tiers.Availability(2, attached, num_nodes=None, cuda_count=lambda: 8, deepspeed_missing=lambda: None)
    decided = _decide(avail=avail)
    assert decided["ddp-multinode"] is None and "multinode" not in avail._cache  # nodes not agreed yet
    assert decided["ddp"][0] == "cpu" and "pytest is rank 0 of a torchrun world of 4 ranks" in decided["ddp"][1]


def test_not_run_line_says_why_and_how():
    assert tiers.not_run_line("gpu", GPU_REASON) == \
        "ltconform: gpu tier not run: needs 2 CUDA devices, found 0 (on a GPU runner: -m ltconform_gpu; docs/ci.md)"
    assert tiers.not_run_line(*MULTINODE) == f"ltconform: multinode tier not run: {MULTINODE[1]}"  # says it already
    assert tiers.not_run_line("deepspeed", DS_REASON) == \
        f"ltconform: deepspeed tier not run: {DS_REASON} (once installed, the [deepspeed] items run; docs/ci.md)"


# -- the Trainer kwargs the plugin replaces --------------------------------------------------------

def test_overridden_lists_every_replaced_value_and_matches_what_is_built(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar

    ckpt = ModelCheckpoint()
    user = {"devices": 8, "strategy": "ddp_spawn", "max_epochs": 100, "accelerator": "gpu", "num_nodes": 2,
            "logger": True, "enable_progress_bar": True, "enable_model_summary": True, "max_time": "00:01:00:00",
            "max_steps": 1000, "limit_val_batches": 1.0, "limit_train_batches": 0.25, "default_root_dir": "/runs",
            "precision": "bf16-mixed", "accumulate_grad_batches": 4, "enable_checkpointing": True,
            "callbacks": [TQDMProgressBar(), ckpt]}
    said = trainer_overrides.overridden(user, 2, strategies=("ddp",))
    assert said == [
        "devices=8 -> 2 (the world size)", "strategy='ddp_spawn' -> DDP in started ranks",
        "max_epochs=100 -> 4 (the cap)", "accelerator='gpu' -> 'cpu' (the CPU tier)", "num_nodes=2 -> 1",
        "logger=True -> off", "enable_progress_bar=True -> False", "enable_model_summary=True -> False",
        "max_time='00:01:00:00' -> no time limit (runs are bounded by epochs and batches)",
        "max_steps=1000 -> 16 (the cap)", "limit_val_batches=1.0 -> 4 (the cap)", "default_root_dir='/runs' -> "
        "a temporary folder per run, shared by its ranks", "callbacks: TQDMProgressBar removed (no progress bar)"]
    # The same keys are the ones build_trainer_kwargs changes (the strategy is built by adapt_strategy).
    built = harness.build_trainer_kwargs(user, "ddp", 2, str(tmp_path), accelerator="cpu", num_nodes=1)
    changed = {k for k in user if k != "strategy" and built.get(k, "<removed>") != user[k]}
    assert changed == {re.match(r"\w+", s).group(0) for s in said} - {"strategy"}
    assert built["callbacks"] == [ckpt] and built["limit_train_batches"] == 0.25

    every = trainer_overrides.overridden({"strategy": "ddp_spawn", "precision": "16-mixed"}, 2,
                               strategies=("ddp", "fsdp", "deepspeed"))
    assert every == ["strategy='ddp_spawn' -> DDP in started ranks on the [ddp] items",
                     "precision='16-mixed' -> '32-true' on the [deepspeed] items (half precision under DeepSpeed "
                     "needs a GPU)"]
    assert trainer_overrides.overridden({"devices": 2, "accelerator": "cpu", "strategy": "ddp", "max_epochs": 3,
                               "logger": False, "accumulate_grad_batches": 2}, 2) == []


def test_overridden_strategy_follows_adapt_strategy():
    import lightning.pytorch as L
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    spawn = DDPStrategy(start_method="spawn")
    assert trainer_overrides.overridden({"strategy": spawn}, 2) == \
        ["strategy=DDPStrategy(start_method='spawn') -> DDP in started ranks"]
    assert trainer_overrides.overridden({"strategy": SingleDeviceStrategy("cpu")}, 2) == \
        ["strategy=SingleDeviceStrategy -> DDP"]
    for kept in (DDPStrategy(), "ddp", "auto", "ddp_find_unused_parameters_true", "fsdp", "deepspeed_stage_2"):
        assert trainer_overrides.overridden({"strategy": kept}, 2) == [], kept
    # What adapt_strategy builds agrees: a new DDPStrategy for the spawn one, the user's own otherwise.
    assert adapt_is_users(L, spawn) is False and adapt_is_users(L, DDPStrategy()) is True


def adapt_is_users(ns, strategy) -> bool:
    return harness.adapt_strategy(ns, "ddp", strategy, 10.0) is strategy


def test_a_progress_bar_callback_no_longer_stops_the_trainer(tmp_path):
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import TQDMProgressBar

    kwargs = harness.build_trainer_kwargs({"callbacks": TQDMProgressBar()}, "auto", 1, str(tmp_path),
                                          accelerator="cpu", num_nodes=1)
    trainer = L.Trainer(**kwargs)  # Lightning refuses a ProgressBar callback with enable_progress_bar=False
    assert not [c for c in trainer.callbacks if isinstance(c, TQDMProgressBar)]


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_a_users_model_checkpoint_keeps_checkpointing_on(tmp_path, namespace):
    import importlib

    pl = importlib.import_module(namespace)
    ckpt = pl.callbacks.ModelCheckpoint(monitor="val_loss")
    kwargs = harness.build_trainer_kwargs({"callbacks": [ckpt]}, "auto", 1, str(tmp_path),
                                          accelerator="cpu", num_nodes=1)
    assert kwargs["enable_checkpointing"] is True
    trainer = pl.Trainer(**kwargs)  # refused next to enable_checkpointing=False
    assert trainer.checkpoint_callbacks == [ckpt]
    # Without a checkpoint callback of theirs, Lightning's default one (files only) stays off.
    assert harness.build_trainer_kwargs({}, "auto", 1, str(tmp_path))["enable_checkpointing"] is False
    # An explicit choice of the user's is kept.
    kept = harness.build_trainer_kwargs({"callbacks": [ckpt], "enable_checkpointing": True}, "auto", 1, str(tmp_path))
    assert kept["enable_checkpointing"] is True


def test_progress_line():
    assert progress.progress_line("fit[ddp]", 30.4, {0: 1.0, 1: 20.2}, 10.0) == \
        "ltconform: fit[ddp] running, 30 s; waiting for rank 1 (no progress for 20 s)"
    assert progress.progress_line("fit-reference[ddp]", 12.0, {0: 3.0}, 10.0) == \
        "ltconform: fit-reference[ddp] running, 12 s"


# -- end to end ------------------------------------------------------------------------------------

KWARGS = '''
def trainer_kwargs():
    return {"devices": 8, "strategy": "ddp_spawn", "max_epochs": 100}
'''


def test_first_run_hides_tiers_that_cannot_run_and_says_when_nothing_was_judged(pytester):
    pytester.makeconftest(NO_DEEPSPEED)
    pytester.makepyfile(kw=KWARGS)
    report = pytester.path / "r.json"
    result = pytester.runpytest_subprocess(
        "--ltconform", BORING, "--ltconform-trainer", "kw:trainer_kwargs", "--ltconform-strategies", "ddp,deepspeed",
        "-k", "deepspeed", "--ltconform-report", str(report), "-p", "no:cacheprovider", "-v", "-rs")
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.OK, out[-3000:]
    result.stdout.fnmatch_lines([
        f"ltconform: gpu tier not run: {GPU_REASON} (on a GPU runner: -m ltconform_gpu; docs/ci.md)",
        _fn(f"ltconform: multinode tier not run: {MULTINODE[1]}"),
        # Only ddp runs here (deepspeed cannot), so the strategy phrase names no item kind.
        "ltconform: your Trainer kwargs: devices=8 -> 2 (the world size), strategy='ddp_spawn' -> DDP in started "
        "ranks, max_epochs=100 -> 4 (the cap), devices=8 -> 1 (ranks per node) on the [ddp-2nodes] items",
    ])
    # Collected: the CPU ddp items (deselected by -k) and the deepspeed ones, asked for by name; no
    # gpu or multinode item exists.
    ids = re.findall(r"^(ltconform::\S+)", out, re.M)
    assert ids and not [i for i in ids if i.endswith(("-gpu]", "-multinode]"))], ids
    assert {i.split("::")[-1] for i in ids} >= {"sync-dist[deepspeed]", "all-rank-save[deepspeed]"}
    outcomes = result.parseoutcomes()
    assert outcomes["skipped"] == 6 and "passed" not in outcomes, outcomes
    assert re.search(r"collected 24 items / 18 deselected / 6 selected", out), out[:2000]
    result.stdout.fnmatch_lines([_fn(f"ltconform: nothing was judged: every selected item needs a tier that cannot "
                                     f"run here: {DS_REASON}"),
                                 _fn("SKIPPED [6] ltconform: " + DS_REASON)])
    assert "deepspeed tier not run" not in out  # asked for: its items exist and skip

    results = json.loads(report.read_text())["results"]
    by_id = {f"{r['contract']}[{r['strategy']}]": r for r in results}
    ds = by_id["sync-dist[deepspeed]"]
    assert (ds["outcome"], ds["message"], ds["category"]) == ("skipped", DS_REASON, "unavailable")
    # Items of tiers not run here are counted per tier as -k would have selected them: the deepspeed-gpu
    # ones only (deepspeed asked for, the gpu tier not), one per contract with a deepspeed item.
    assert not [k for k in by_id if k.endswith(("-gpu]", "-multinode]"))], sorted(by_id)
    assert json.loads(report.read_text())["not_run"] == [{"tier": "gpu", "reason": GPU_REASON, "items": 6}]
    assert not [k for k in by_id if k.endswith("[ddp]")]  # deselected items are not in the report

    # Without deepspeed in -k: the gpu and multinode counts of the contracts -k selects, and no others.
    report.unlink()
    collected = pytester.runpytest_subprocess("--ltconform", BORING, "--ltconform-strategies", "ddp", "-k",
                                              "sync-dist or launch-env", "--collect-only", "-q",
                                              "--ltconform-report", str(report), "-p", "no:cacheprovider")
    assert collected.ret == pytest.ExitCode.OK, collected.stdout.str()[-2000:]
    doc = json.loads(report.read_text())
    assert doc["results"] == []
    # sync-dist[ddp-gpu]; sync-dist[ddp-multinode] and launch-env[ddp-multinode].
    assert doc["not_run"] == [{"tier": "gpu", "reason": GPU_REASON, "items": 1},
                              {"tier": "multinode", "reason": MULTINODE[1], "items": 2}]


SLOW = '''
import time

from lightning.pytorch.demos.boring_classes import BoringModel


class Model(BoringModel):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.current_epoch == 0 and batch_idx == 0:
            time.sleep(6.0)  # rank 1's trace stops growing; rank 0 soon waits for it in a collective
        return super().training_step(batch, batch_idx)


def trainer_kwargs():
    return {"max_epochs": 1}
'''


def test_a_long_run_shows_live_progress(pytester, monkeypatch, no_leftover_ranks):
    pytester.makepyfile(slow_model=SLOW)
    monkeypatch.setenv(progress.PROGRESS_ENV, "2")  # a line after 2 s, then every 2 s (default 10 s)
    result = pytester.runpytest_subprocess(
        "--ltconform", "slow_model.Model", "--ltconform-trainer", "slow_model:trainer_kwargs",
        "--ltconform-strategies", "ddp", "--ltconform-nodes", "1", "-k", "sync-dist", "-p", "no:cacheprovider")
    out = result.stdout.str()
    result.assert_outcomes(passed=1, deselected=result.parseoutcomes().get("deselected", 0))
    lines = [ln for ln in result.stdout.lines if ln.startswith("ltconform: fit")]
    assert lines and all(re.fullmatch(r"ltconform: fit\[ddp\] running, \d+ s(; waiting for .*)?", ln)
                         for ln in lines), out[-3000:]
    assert any(re.search(r"waiting for .*rank 1 \(no progress for \d+ s\)", ln) for ln in lines), lines
    seconds = [int(re.search(r"running, (\d+) s", ln).group(1)) for ln in lines]
    assert seconds == sorted(seconds) and seconds[0] >= 2 and len(set(seconds)) == len(seconds), seconds
    # pytest's progress line goes on after the live lines with its prefix: no outcome letter alone on a line.
    after = result.stdout.lines[result.stdout.lines.index(lines[-1]) + 1]
    assert re.fullmatch(r"ltconform \.\s+\[100%\]", after), out[-3000:]
    assert "your Trainer kwargs" not in out  # max_epochs=1 is kept: nothing to say
