"""Fast unit tests of the data-sharding, shared-writes, strategy-config, spawn-safety and
effective-batch contracts: their rank-side helpers on real objects and their verdicts on
hand-made run data (the worlds themselves are exercised by the corpus, tests/test_corpus.py)."""

from __future__ import annotations

import os
import sys
import textwrap
import threading
import types

import pytest

from pytest_ltconform.contracts import get_contract
from pytest_ltconform.contracts.base import Run


class _Rank:
    def __init__(self, rank, trace=(), value=None, status="ok", exc_type=None, message=None, traceback=None):
        self.rank, self.trace, self.value, self.status = rank, list(trace), value, status
        self.exc_type, self.message, self.traceback = exc_type, message, traceback
        self.exit_code = None


class _Job:
    def __init__(self, ranks, status="ok", divergence=None):
        self.ranks, self.status, self.divergence = ranks, status, divergence
        self.world_size = len(ranks)
        self.diagnosis = None

    def failure_text(self):
        return ""


def _run(traces=None, values=None, **job):
    n = len(traces or values)
    ranks = [_Rank(r, (traces or [[]] * n)[r], (values or [None] * n)[r]) for r in range(n)]
    return Run(_Job(ranks, **job), "ddp", "fit")


# -- data-sharding -------------------------------------------------------------------------------

def _batches(rank_rows, epoch=0):
    return [{"ev": "batch", "stage": "train", "idx": i, "dl": 0, "epoch": epoch, "n": len(rows),
             "fp": "|".join(rows), "rows": rows} for i, rows in enumerate(rank_rows)]


def test_data_sharding_identical_batches_fail_and_disjoint_pass():
    contract = get_contract("data-sharding")
    same = _batches([["a", "b"], ["c", "d"]])
    verdict = contract.judge(_run([same, same]))
    assert verdict.outcome == "failed" and "identical train batches in every step" in verdict.summary
    other = _batches([["e", "f"], ["g", "h"]])
    assert contract.judge(_run([same, other])).outcome == "passed"


def test_data_sharding_uneven_counts_and_replay_within_rank():
    contract = get_contract("data-sharding")
    verdict = contract.judge(_run([_batches([["a"], ["b"], ["c"]]), _batches([["d"], ["e"]])]))
    assert verdict.outcome == "failed" and "rank 0: 3 batches, rank 1: 2 batches" in verdict.summary
    replay = _batches([["a", "b"], ["a", "b"]])
    verdict = contract.judge(_run([replay, _batches([["c", "d"], ["c", "d"]])]))
    assert verdict.outcome == "failed" and "more than once" in verdict.summary


def test_data_sharding_recreate_failure_names_the_dataloader_line():
    contract = get_contract("data-sharding")
    tb = ('Traceback (most recent call last):\n  File "/site-packages/lightning/pytorch/utilities/data.py", '
          'line 1, in _update_dataloader\n')
    created = {"ev": "ds_created", "site": {"file": "/u/dm.py", "line": 7, "func": "DM.train_dataloader"},
               "positional": 4, "hook": "DM.train_dataloader"}
    ranks = [_Rank(r, [created], status="error", exc_type="MisconfigurationException",
                   message="The DataLoader implementation has an error where more than one `__init__` argument",
                   traceback=tb) for r in range(2)]
    verdict = contract.judge(Run(_Job(ranks, status="error"), "ddp", "fit"))
    assert verdict.outcome == "failed"
    assert "positionally" in verdict.summary and "/u/dm.py:7" in verdict.render()


def test_fingerprint_rows_and_ids():
    import torch

    from pytest_ltconform.contracts.data_sharding import fingerprint

    fp = fingerprint((torch.arange(6.0).reshape(3, 2), torch.tensor([5, 6, 7])))
    assert fp["n"] == 3 and len(fp["rows"]) == 3 and fp["ids"] == [5, 6, 7]
    assert fingerprint((torch.arange(6.0).reshape(3, 2), torch.tensor([5, 6, 7])))["fp"] == fp["fp"]


# -- shared-writes -------------------------------------------------------------------------------

class _Recorder:
    def __init__(self):
        self.events = []
        self._fh = open(os.devnull, "w")
        self._patches = []

    def emit(self, event):
        self.events.append(event)

    def current_hook(self):
        return "Model.on_train_end"

    def _patch(self, owner, name, factory):
        original = getattr(owner, name)
        setattr(owner, name, factory(original))
        self._patches.append((owner, name, original))

    def undo(self):
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)


def test_shared_writes_probe_records_open_and_torch_save(tmp_path, monkeypatch):
    import torch

    from pytest_ltconform.contracts import shared_writes

    monkeypatch.chdir(tmp_path)
    recorder = _Recorder()
    probe = shared_writes.SharedWritesProbe()
    try:
        probe.before_trainer(None, {"default_root_dir": str(tmp_path)}, recorder)
        with open("history.csv", "a") as fh:  # this file is user code for the probe
            fh.write("1\n")
        with open("history.csv") as fh:
            fh.read()
        torch.save({"w": torch.zeros(2)}, str(tmp_path / "model.pt"))
        fd = os.open(str(tmp_path / "raw.bin"), os.O_WRONLY | os.O_CREAT)
        os.close(fd)
    finally:
        probe.collect(None, None, recorder)
        recorder.undo()
    writes = [(os.path.basename(e["path"]), e["mode"]) for e in recorder.events]
    assert ("history.csv", "a") in writes and ("model.pt", "torch.save") in writes
    assert any(name == "raw.bin" for name, _ in writes)
    assert all(e["path"].startswith(shared_writes.ROOT) for e in recorder.events)
    assert len([w for w in writes if w[0] == "history.csv"]) == 1  # the read is not a write


def test_shared_writes_verdicts():
    contract = get_contract("shared-writes")
    site = {"file": "/u/m.py", "line": 3, "func": "Model.on_validation_epoch_end"}
    write = {"ev": "write", "path": "<default_root_dir>/val.csv", "mode": "a", "site": site,
             "hook": "Model.on_validation_epoch_end", "epoch": 0}
    verdict = contract.judge(_run([[write], [write]]))
    assert verdict.outcome == "failed" and "val.csv opened for appending by rank 0 and rank 1" in verdict.summary
    assert contract.judge(_run([[write], []])).outcome == "passed"


# -- strategy-config -----------------------------------------------------------------------------

def test_strategy_config_deepspeed_findings(tmp_path):
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
    run = _run(values=[{"config": {"strategy": "DeepSpeedStrategy", "precision": "32-true", "accumulate": 1,
                                   "findings": facts}}])
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


# -- spawn-safety --------------------------------------------------------------------------------

def test_find_unpicklable_names_the_attribute_path():
    import torch

    from pytest_ltconform.contracts.spawn_safety import find_unpicklable

    class Holder:
        pass

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.extra = {"ok": 1, "fn": lambda x: x}
    found = find_unpicklable(model, "Model")
    assert found["path"] == "Model.extra['fn']" and found["what"] == "a lambda" and found["site"]["line"]
    holder = Holder()
    holder.lock = threading.Lock()
    assert "lock" in find_unpicklable({"cb": [holder]}, "trainer_kwargs")["what"]
    assert find_unpicklable({"a": [1, 2]}, "x") is None


@pytest.mark.parametrize("spawn_config,outcome", [(True, "failed"), (False, "advisory")])
def test_spawn_safety_pickling_is_advisory_without_spawn(spawn_config, outcome):
    item = {"path": "Model.loss_fn", "what": "a lambda", "error": "PicklingError", "site": None}
    facts = {"pickling": [item], "fresh": {"tripped": None, "trainers": [], "error": None, "seconds": 1.0},
             "spawn_config": spawn_config, "tripped_here": [], "module": "m"}
    verdict = get_contract("spawn-safety").judge(_run(values=[{"spawn": facts}, {"spawn": None}]))
    assert verdict.outcome == outcome and "Model.loss_fn does not pickle" in verdict.summary


def test_tripwire_keeps_the_partial_module(tmp_path, monkeypatch):
    from pytest_ltconform import tripwire

    (tmp_path / "train_at_import_mod.py").write_text(textwrap.dedent("""
        import lightning.pytorch as L
        class Model(L.LightningModule):
            pass
        L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False).fit(Model())
        AFTER = True
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        mod = tripwire.import_module("train_at_import_mod")
        assert hasattr(mod, "Model") and not hasattr(mod, "AFTER")
        assert sys.modules["train_at_import_mod"] is mod
        assert tripwire.TRIPPED["train_at_import_mod"]["method"] == "Trainer.fit"
        assert tripwire.TRIPPED["train_at_import_mod"]["line"] == 5
        import lightning.pytorch as L

        assert "entry" not in L.Trainer.fit.__name__  # disarmed again
    finally:
        sys.modules.pop("train_at_import_mod", None)
        tripwire.TRIPPED.pop("train_at_import_mod", None)


# -- effective-batch -----------------------------------------------------------------------------

def test_concat_and_report():
    import torch

    from pytest_ltconform.contracts.effective_batch import EffectiveBatch, _concat

    out = _concat([(torch.zeros(2, 3), {"m": torch.ones(2)}), (torch.ones(4, 3), {"m": torch.zeros(4)})])
    assert out[0].shape == (6, 3) and out[1]["m"].shape == (6,)
    loader = {"batches": 5, "samples": 18, "batch_size": 4, "drop_last": False}
    report, notes = EffectiveBatch._report([{"loader": loader}, {"loader": loader}], 4, 2, 2)
    assert "Effective batch 16 = 4 (per rank) x 2 (ranks) x 2 (accumulation)" in report
    assert any("partial final window" in n for n in notes) and any("uneven last batch" in n for n in notes)


@pytest.mark.parametrize("ratio,passed", [(1.0, True), (0.5, False), (1.3, False)])
def test_effective_batch_ratio(ratio, passed):
    values = [{"ebatch": {"sizes": [4], "accumulate": 1, "stepped": True, "loader": {}, "loss_lines": []}}] * 2
    run = _run(values=values)
    ref = _run(values=[{"reference": {"norm": 2.0, "world_norm": 2.0 * ratio, "cosine": 1.0, "stepped": True,
                                      "per_param": []}}])
    run.reference = ref
    verdict = get_contract("effective-batch").judge(run)
    assert (verdict.outcome == "passed") is passed
    if ratio == 0.5:
        assert "shrinks by the world size" in verdict.summary


# -- through the plugin ----------------------------------------------------------------------------

@pytest.mark.slow
def test_plugin_fails_shared_writes_and_spawn_safety_items(pytester, no_leftover_ranks):
    from conftest import case

    path = case("spawn-safety/lambda_loss_and_open_log_file.py").rsplit(":", 1)[0]
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--ltconform", f"{path}:Model", "--ltconform-datamodule", f"{path}:DataModule",
        "--ltconform-trainer", f"{path}:trainer_kwargs",
        "-k", "(spawn-safety or shared-writes or data-sharding) and not gpu and not multinode and not fsdp", "-v")
    out = result.stdout.str()
    result.assert_outcomes(failed=1, passed=2)
    assert "Model.loss_fn does not pickle: it is a lambda" in out and "DataModule.log" in out
