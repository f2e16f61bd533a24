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


def _spawn_facts():
    return {"pickling": [], "fresh": {"tripped": None, "trainers": [], "error": None, "seconds": 1.0},
            "spawn_config": False, "tripped_here": [], "module": "m"}


def _workers(start, explicit, unpicklable):
    return {"ev": "spawn_workers", "hook": "train_dataloader", "start": start, "explicit": explicit, "workers": 1,
            "unpicklable": unpicklable, "built": {"file": "/x/m.py", "line": 40, "func": "Model.train_dataloader"}}


_LOCAL = {"path": "train_dataloader().worker_init_fn", "what": "a function defined inside Model.train_dataloader",
          "error": "AttributeError: Can't pickle local object 'Model.train_dataloader.<locals>.seed_worker'",
          "site": {"file": "/x/m.py", "line": 36, "func": "Model.train_dataloader.<locals>.seed_worker"}}


@pytest.mark.parametrize("start, explicit, outcome", [("spawn", True, "failed"), ("forkserver", True, "failed"),
                                                       ("fork", False, "advisory")])
def test_what_dataloader_workers_receive_is_judged_from_the_fit(fake_runs, start, explicit, outcome):
    """Issue 38 §2: a worker_init_fn defined inside train_dataloader, workers started by spawn: the
    fit stops when they start (spawn-safety fails, naming the attribute path and its line); started
    by fork (Linux's default) it would stop only on macOS and Windows: an advisory."""
    run = fake_runs.run(values=[{"probes": {"spawn-safety": _spawn_facts()}}, {"probes": {"spawn-safety": None}}],
                        kind="spawn")
    run.observed["fit"] = fake_runs.run([[_workers(start, explicit, [_LOCAL])], []])
    verdict = get_contract("spawn-safety").judge(run)
    assert verdict.outcome == outcome, verdict.render()
    text = verdict.render()
    assert verdict.summary.startswith("train_dataloader().worker_init_fn does not pickle: it is a function defined "
                                      "inside Model.train_dataloader")
    assert "/x/m.py:36" in text and "the train_dataloader DataLoader is built here" in text
    assert ("macOS and Windows" in verdict.summary) == (start == "fork")
    assert "module level" in verdict.fix


def test_workers_that_receive_picklable_things_pass_and_say_what_was_checked(fake_runs):
    run = fake_runs.run(values=[{"probes": {"spawn-safety": _spawn_facts()}}, {"probes": {"spawn-safety": None}}],
                        kind="spawn")
    run.observed["fit"] = fake_runs.run([[_workers("spawn", True, [])], []])
    verdict = get_contract("spawn-safety").judge(run)
    assert verdict.outcome == "passed"
    assert "what the DataLoader workers of the fit receive (dataset, collate_fn, worker_init_fn) pickles: " \
           "train_dataloader (1 started by spawn)" in verdict.summary


def test_spawn_safety_claims_only_the_fit_of_its_own_strategy(fake_runs):
    raised = [{"ev": "raised", "owner": "spawn-safety", "in": "DataLoader workers"}]
    ranks = [fake_runs.rank(r, raised, status="error", exc_type="AttributeError", message="Can't pickle")
             for r in (0, 1)]
    contract = get_contract("spawn-safety")
    ddp = fake_runs.of(ranks, status="error")
    assert contract.blames(ddp) is not None
    ddp.strategy = "fsdp"
    assert contract.blames(ddp) is None  # no spawn-safety[fsdp] item to name


def test_pickling_a_huge_object_gives_up_without_keeping_it(monkeypatch):
    from pytest_ltconform.contracts.spawn_safety import probe

    monkeypatch.setattr(probe, "PICKLE_LIMIT", 1000)
    assert probe._pickle_error(b"x" * 10_000) is None
    assert probe._pickle_error([lambda: 0]) is not None


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
