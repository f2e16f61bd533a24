"""spawn-safety: the unpicklable-attribute search and the import tripwire on real objects and
modules, and the verdict on hand-made spawn facts."""

from __future__ import annotations

import sys
import textwrap
import threading

import pytest

from pytest_ltconform.contracts import get_contract


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
def test_spawn_safety_pickling_is_advisory_without_spawn(spawn_config, outcome, fake_runs):
    item = {"path": "Model.loss_fn", "what": "a lambda", "error": "PicklingError", "site": None}
    facts = {"pickling": [item], "fresh": {"tripped": None, "trainers": [], "error": None, "seconds": 1.0},
             "spawn_config": spawn_config, "tripped_here": [], "module": "m"}
    verdict = get_contract("spawn-safety").judge(fake_runs.run(values=[{"probes": {"spawn-safety": facts}},
                                                                               {"probes": {"spawn-safety": None}}]))
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
