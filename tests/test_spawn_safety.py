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

    from pytest_ltconform.contracts.spawn_safety.probe import find_unpicklable

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


# A package with a process-global registry filled at import time (GraphGym's register_loader).
REGISTRY = '''
LOADERS = {}


def register_loader(name, guard):
    def register(fn):
        if name in LOADERS and not guard:
            raise KeyError(f"{name!r} is already defined")
        LOADERS.setdefault(name, fn)
        return fn
    return register
'''

REGISTERING_TARGET = '''
import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

import fakereg


class Synthetic(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, generator=g), torch.randn(1, generator=g)


@fakereg.register_loader("synthetic", guard=GUARD)
def load():
    return Synthetic()


class DataModule(L.LightningDataModule):
    def __init__(self):
        super().__init__()
        self.dataset = fakereg.LOADERS["synthetic"]()  # held, so pickling the datamodule pickles it

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=4)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
'''


@pytest.mark.parametrize("guard", [False, True])
def test_a_user_module_runs_once_per_process_so_import_time_registries_hold(pytester, monkeypatch, guard,
                                                                             no_leftover_ranks):
    """Every rank runs several jobs, and the pytest process loads the target more than once; a file
    executed again makes new classes while the package's registry keeps the first execution's
    loader: the dataset it builds no longer pickles ('not the same object', a false advisory), or
    the re-import raises KeyError 'already defined' (field26 GraphGym). The module is executed once."""
    packages = pytester.path / "lib" / "site-packages"
    packages.mkdir(parents=True)
    (packages / "fakereg.py").write_text(REGISTRY)
    monkeypatch.setenv("PYTHONPATH", str(packages))
    pytester.makepyfile(reg=REGISTERING_TARGET.replace("GUARD", str(guard)))
    result = pytester.runpytest_subprocess("--ltconform", "reg.py:Model", "--ltconform-datamodule", "reg.py:DataModule",
                                           "--ltconform-strategies", "ddp", "-k", "unused or spawn",
                                           "-p", "no:cacheprovider", "-rA")
    out = result.stdout.str()
    assert "already defined" not in out and "not the same object" not in out and "does not pickle" not in out
    result.stdout.fnmatch_lines(["*PASSED ltconform::reg.py:Model::unused-parameters[[]ddp[]]*"])
    result.stdout.fnmatch_lines(["*PASSED ltconform::reg.py:Model::spawn-safety[[]ddp[]]*"])
