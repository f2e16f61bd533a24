"""Several targets in one session: the three ways to name them, their ids, bad and duplicate
targets, the report per target, and one session of three targets sharing one world.

Everything except the last test starts no world: parsing and validation run in this process or in
an in-process pytester run with ``--collect-only``.
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from conftest import BORING, CONFORMANCE

pytest_plugins = ["pytester"]

MODULES = '''
import torch
import lightning.pytorch as L
from torch.utils.data import DataLoader, TensorDataset

class Good(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()
    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

class Sized(Good):
    def __init__(self, hidden, lr=0.1):
        super().__init__()
        self.layer = torch.nn.Linear(2, hidden)
        self.lr = lr

class Data(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)

def trainer_ok():
    return {"max_epochs": 1}

def trainer_deepspeed():
    return {"strategy": "deepspeed_stage_2"}

def broken_factory():
    raise ValueError("checkpoint path not set")
'''


@pytest.fixture(autouse=True)
def _lightning_stays_imported():
    """In-process pytester runs unload the modules they imported; torch refuses to import some of
    Lightning's twice, so they are imported once, outside the runs."""
    import lightning.pytorch.demos.boring_classes  # noqa: F401


@pytest.fixture
def targets_mod(tmp_path, monkeypatch):
    """A module of targets on sys.path, as the ``targets_mod`` name."""
    (tmp_path / "targets_mod.py").write_text(MODULES)
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "targets_mod", raising=False)
    return tmp_path


# -- parsing: no import ------------------------------------------------------------------------------

def test_a_value_names_the_target_then_its_own_datamodule_trainer_and_id():
    from pytest_ltconform.settings import parse_target

    t = parse_target("  pkg.mod.Model   datamodule=pkg.mod.Data trainer=pkg.mod:kwargs ", "--ltconform")
    assert (t.model, t.datamodule, t.trainer, t.init) == ("pkg.mod.Model", "pkg.mod.Data", "pkg.mod:kwargs", None)
    assert t.id == "pkg.mod.Model datamodule=pkg.mod.Data trainer=pkg.mod:kwargs"  # as written, spaces folded
    assert t.source == "--ltconform"
    named = parse_target("pkg.mod.Model id=small", "--ltconform")
    assert (named.id, named.datamodule, named.trainer) == ("small", None, None)
    assert parse_target("path/to/model.py:Net", "--ltconform").id == "path/to/model.py:Net"


@pytest.mark.parametrize("value, why", [
    ("pkg.M datamodul=pkg.D", "'datamodul=pkg.D' is not KEY=VALUE with a known key"),
    ("pkg.M pkg.D", "'pkg.D' is not KEY=VALUE with a known key"),
    ("pkg.M trainer=", "trainer= has no value"),
    ("pkg.M trainer=a:b trainer=a:c", "'trainer' is given twice"),
])
def test_unknown_or_malformed_keys_name_the_value_and_the_accepted_keys(value, why):
    from pytest_ltconform.settings import parse_target

    with pytest.raises(pytest.UsageError) as info:
        parse_target(value, "--ltconform")
    assert str(info.value) == (f"--ltconform {value!r}: {why}; after the target only datamodule=..., trainer=..., "
                               f"id=... are accepted.")


def test_the_target_comes_first():
    from pytest_ltconform.settings import parse_target

    with pytest.raises(pytest.UsageError, match=r"'datamodule=pkg.D pkg.M': the value starts with the "
                                                r"LightningModule target"):
        parse_target("datamodule=pkg.D pkg.M", "ini option 'ltconform_target'")


def test_declared_target_records_where_and_its_written_form():
    from pytest_ltconform import Target

    t = Target("pkg.M", datamodule="pkg.D", trainer={"max_epochs": 1}, init={"hidden": 4})
    assert t.source == f"{__file__}:{sys._getframe().f_lineno - 1}"
    assert t.id == t.written == "pkg.M datamodule=pkg.D"  # a dict has no written form
    assert Target("pkg.M", id="x").id == "x"
    assert repr(t) == "Target('pkg.M', datamodule='pkg.D', trainer={'max_epochs': 1}, init={'hidden': 4})"


# -- validation in this process ----------------------------------------------------------------------

def test_init_builds_the_module_and_a_trainer_dict_is_kept(targets_mod):
    from pytest_ltconform.target import loading as target_loading
    from pytest_ltconform.target import validation as target_validation

    t = target_validation.validate("targets_mod.Sized", init={"hidden": 3}, trainer={"max_epochs": 2}, id="sized")
    assert (t.id, t.init, t.trainer_dict, t.trainer, t.trainer_keys) == \
        ("sized", {"hidden": 3}, {"max_epochs": 2}, None, ("max_epochs",))
    assert target_loading.user_trainer_kwargs(t) == {"max_epochs": 2}
    model = target_loading.instantiate(t.model, "LightningModule", "LightningModule", t.init)
    assert model.layer.out_features == 3 and model.lr == 0.1


@pytest.mark.parametrize("kwargs, expected", [
    ({"init": {"hiden": 3}}, "--ltconform 'targets_mod.Sized': init={'hiden': 3} does not fit Sized(hidden, lr=0.1): "
                             "'hiden' is not a parameter; 'hidden' is required but not given. Use the constructor's "
                             "parameter names in init."),
    ({"init": {"hidden": lambda: 3}}, "--ltconform 'targets_mod.Sized': init: the value of 'hidden' does not pickle"),
    ({"init": {"hidden": 3}, "trainer": {"max_epoch": 2}}, "--ltconform-trainer: max_epoch is not a Trainer argument"),
    ({"init": {"hidden": 3}, "trainer": {"callbacks": [lambda: 0]}},
     "--ltconform-trainer: the value of 'callbacks' does not pickle"),
    ({}, "--ltconform 'targets_mod.Sized': Sized() cannot be constructed without arguments (__init__ requires hidden)"),
])
def test_bad_init_or_trainer_dict_says_which_argument(targets_mod, kwargs, expected):
    from pytest_ltconform.target import spec as target_spec
    from pytest_ltconform.target import validation as target_validation

    with pytest.raises(target_spec.TargetError) as info:
        target_validation.validate("targets_mod.Sized", **kwargs)
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)


NET = "KIND = {kind!r}\n\nclass Net:\n    kind = KIND\n"


def test_file_targets_with_one_basename_load_as_distinct_modules(tmp_path, monkeypatch):
    """Three folders each with model.py: each target gets its own module, loading one twice
    gives the same class (what pickle needs), and a third file does not replace the second."""
    from pytest_ltconform.target import loading as target_loading
    from pytest_ltconform.target import spec as target_spec

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    specs = []
    for kind in ("a", "b", "c"):
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "model.py").write_text(NET.format(kind=kind))
        specs.append(target_spec.parse(f"{tmp_path / kind / 'model.py'}:Net", "--ltconform"))
    classes = [target_loading.load_object(spec) for spec in specs]
    assert [c.kind for c in classes] == ["a", "b", "c"]
    assert [target_loading.load_object(spec) for spec in specs] == classes  # not executed again
    for spec, cls in zip(specs, classes):
        module = sys.modules[cls.__module__]
        assert module.__file__ == spec.path and module.Net is cls
    assert len({c.__module__ for c in classes}) == 3


def test_own_imports_forgets_the_user_modules_of_one_target(tmp_path, monkeypatch):
    from pytest_ltconform.target import loading as target_loading
    from pytest_ltconform.target import spec as target_spec

    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    for kind in ("a", "b"):
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "helpers.py").write_text(f"KIND = {kind!r}\n")
        (tmp_path / kind / "model.py").write_text("from helpers import KIND\n\nclass Net:\n    kind = KIND\n")
    path = list(sys.path)
    kinds = []
    for kind in ("a", "b"):
        with target_loading.own_imports():
            spec = target_spec.parse(f"{tmp_path / kind / 'model.py'}:Net", "--x")
            kinds.append(target_loading.load_object(spec).kind)
        assert "helpers" not in sys.modules and "model" not in sys.modules and sys.path == path
    assert kinds == ["a", "b"]  # b's model imported b's helpers, not a's


def test_a_user_module_forgotten_between_targets_is_executed_once(tmp_path, monkeypatch):
    """Loading the same target again (the pytest process, every job of a rank) gets the module
    executed the first time: a package's import-time registry keeps that execution's classes
    (field26 GraphGym). An edited file is executed again."""
    import os

    from pytest_ltconform.target import loading as target_loading
    from pytest_ltconform.target import spec as target_spec

    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    runs = tmp_path / "runs.txt"
    source = f"with open({str(runs)!r}, 'a') as fh:\n    fh.write('x')\n\nclass Net:\n    pass\n"
    (tmp_path / "model.py").write_text(source)
    spec = target_spec.parse(f"{tmp_path / 'model.py'}:Net", "--x")
    classes = []
    for _ in range(2):
        with target_loading.own_imports():
            classes.append(target_loading.load_object(spec))
        assert "model" not in sys.modules
    assert runs.read_text() == "x" and classes[0] is classes[1]
    (tmp_path / "model.py").write_text(source + "# edited\n")
    os.utime(tmp_path / "model.py", ns=(1, 1))  # a new mtime even within the clock's resolution
    with target_loading.own_imports():
        assert target_loading.load_object(spec) is not classes[0]
    assert runs.read_text() == "xx"


def test_a_module_executed_again_under_a_name_drops_the_earlier_trip(tmp_path, monkeypatch):
    """A rank runs the jobs of several targets: a model.py that trained at import must not be
    reported for the next target's model.py."""
    import importlib.util

    from pytest_ltconform import tripwire

    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    (tmp_path / "trains.py").write_text("import lightning.pytorch as L\nL.Trainer.fit(None, None)\n")
    (tmp_path / "clean.py").write_text("X = 1\n")
    tripwire.exec_guarded("model", importlib.util.spec_from_file_location("model", tmp_path / "trains.py"))
    assert tripwire.TRIPPED["model"]["path"] == str(tmp_path / "trains.py")
    del sys.modules["model"]
    tripwire.exec_guarded("model", importlib.util.spec_from_file_location("model", tmp_path / "clean.py"))
    assert "model" not in tripwire.TRIPPED


# -- the plugin: collect-only, in process -------------------------------------------------------------

def _ids(result) -> list[str]:
    return [line for line in result.stdout.lines if line.startswith("ltconform::")]


def test_repeated_option_gives_each_target_its_items_and_k_selects_by_id(pytester):
    pytester.makepyfile(targets_mod=MODULES)
    args = ["--ltconform", BORING, "--ltconform", "targets_mod.Good trainer=targets_mod:trainer_ok id=good",
            "--ltconform-strategies", "ddp", "-m", "ltconform_cpu", "--collect-only", "-q", "-p", "no:cacheprovider"]
    every = _ids(pytester.runpytest(*args))
    assert f"ltconform::{BORING}::sync-dist[ddp]" in every and "ltconform::good::sync-dist[ddp]" in every
    assert len(every) == 2 * len([i for i in every if i.startswith("ltconform::good::")])
    good = _ids(pytester.runpytest(*args, "-k", "good and sync-dist"))
    assert good == ["ltconform::good::sync-dist[ddp]"]
    boring = _ids(pytester.runpytest(*args, "-k", "BoringModel"))
    assert boring and all(i.startswith(f"ltconform::{BORING}::") for i in boring)


def test_strategy_config_deepspeed_item_only_for_a_target_whose_config_names_deepspeed(pytester):
    pytester.makepyfile(targets_mod=MODULES)
    ids = _ids(pytester.runpytest(
        "--ltconform", "targets_mod.Good trainer=targets_mod:trainer_ok id=plain",
        "--ltconform", "targets_mod.Good trainer=targets_mod:trainer_deepspeed id=ds",
        "--ltconform-strategies", "ddp,deepspeed", "-m", "ltconform_cpu", "-k", "strategy-config or sync-dist",
        "--collect-only", "-q", "-p", "no:cacheprovider"))
    # Both targets run every contract under DeepSpeed; DeepSpeed's own config check is only the
    # DeepSpeed-configured target's (the other has no DeepSpeed config to validate).
    assert sorted(ids) == sorted([
        "ltconform::plain::sync-dist[ddp]", "ltconform::plain::sync-dist[deepspeed]",
        "ltconform::plain::strategy-config[ddp]", "ltconform::ds::sync-dist[ddp]",
        "ltconform::ds::sync-dist[deepspeed]", "ltconform::ds::strategy-config[ddp]",
        "ltconform::ds::strategy-config[deepspeed]"]), ids


def test_configured_strategy_names():
    from lightning.pytorch.strategies import DDPStrategy

    from pytest_ltconform.target import spec as target_spec
    from pytest_ltconform.target import validation as target_validation

    ds = target_spec.ResolvedTarget(model=None, datamodule=None, trainer=None, namespace="lightning.pytorch",
                                    model_name="M",
                                    strategy_names=target_validation._strategy_names("DeepSpeed_Stage_3_Offload"))
    assert ds.configures("deepspeed") and not ds.configures("fsdp")
    ddp = target_spec.ResolvedTarget(model=None, datamodule=None, trainer=None, namespace="lightning.pytorch",
                                     model_name="M", strategy_names=target_validation._strategy_names(DDPStrategy()))
    assert ddp.configures("ddp") and not ddp.configures("deepspeed")
    none = target_spec.ResolvedTarget(model=None, datamodule=None, trainer=None, namespace="x", model_name="M")
    assert not none.configures("ddp")


def test_ini_list_one_target_per_line_with_the_global_datamodule(pytester):
    pytester.makepyfile(targets_mod=MODULES)
    pytester.makeini("[pytest]\nltconform_target =\n    targets_mod.Good\n"
                     "    targets_mod.Good trainer=targets_mod:trainer_ok\n"
                     "ltconform_datamodule = targets_mod.Data\nltconform_strategies = ddp\n")
    pytester.makepyfile(test_user="def test_user_code():\n    pass\n")
    result = pytester.runpytest("-m", "ltconform_cpu or not ltconform", "-k", "sync-dist or user",
                                "--collect-only", "-q", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["test_user.py::test_user_code",
                                 "ltconform::targets_mod.Good::sync-dist[[]ddp[]]",
                                 "ltconform::targets_mod.Good trainer=targets_mod:trainer_ok::sync-dist[[]ddp[]]"])
    # One line keeps working as before.
    pytester.makeini("[pytest]\nltconform_target = targets_mod.Good\nltconform_strategies = ddp\n")
    single = _ids(pytester.runpytest("-m", "ltconform_cpu", "-k", "sync-dist", "--collect-only", "-q"))
    assert single == ["ltconform::targets_mod.Good::sync-dist[ddp]"]


HOOK = '''
from pytest_ltconform import Target

def pytest_ltconform_targets(config):
    return [Target("targets_mod.Sized", init={"hidden": 4}, trainer={"max_epochs": 1}, id="sized"),
            Target("targets_mod.Good", datamodule="targets_mod.Data")]
'''


def test_conftest_hook_declares_targets_that_join_the_normal_run(pytester):
    from pytest_ltconform.controller import ALL_TARGETS_KEY

    pytester.makepyfile(targets_mod=MODULES)
    pytester.makeconftest(HOOK)
    pytester.makepyfile(test_user="def test_user_code():\n    pass\n")
    result = pytester.inline_run("-m", "ltconform_cpu or not ltconform", "-k", "sync-dist or user",
                                 "--ltconform-strategies", "ddp", "--collect-only", "-p", "no:cacheprovider")
    ids = [i.nodeid for i in result.getcalls("pytest_collection_finish")[0].session.items]
    assert ids == ["test_user.py::test_user_code", "ltconform::sized::sync-dist[ddp]",
                   "ltconform::targets_mod.Good datamodule=targets_mod.Data::sync-dist[ddp]"]
    validated = result.getcalls("pytest_collection_finish")[0].session.config.stash[ALL_TARGETS_KEY]
    sized = validated["sized"]
    assert (sized.init, sized.trainer_dict, sized.trainer) == ({"hidden": 4}, {"max_epochs": 1}, None)
    assert sized.declared_at.startswith(str(pytester.path / "conftest.py") + ":")


def test_duplicate_ids_name_both_targets_and_the_fix(pytester):
    pytester.makepyfile(targets_mod=MODULES)
    pytester.makeconftest("from pytest_ltconform import Target\n\ndef pytest_ltconform_targets(config):\n"
                          "    return [Target('targets_mod.Good', trainer={'max_epochs': 1})]\n")
    result = pytester.runpytest("--ltconform", "targets_mod.Good", "--collect-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        "ERROR: targets 1 and 2 have the same id 'targets_mod.Good': Target('targets_mod.Good') (--ltconform) and "
        "Target('targets_mod.Good', trainer={'max_epochs': 1}) (*conftest.py:4). Item ids must differ: give one an "
        "id (id=NAME after the target, or Target(..., id=...) in conftest.py), or name a distinct "
        "datamodule=/trainer= so the targets differ as written."])
    # Both ids given by hand: the only fix is another id.
    result = pytester.runpytest("--ltconform", "targets_mod.Good id=a", "--ltconform", "targets_mod.Good id=a",
                                "--collect-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: targets 1 and 2 have the same id 'a': * Item ids must differ: give one of "
                                 "them another id."])


def test_a_bad_target_in_the_list_is_named_with_its_place(pytester):
    pytester.makepyfile(targets_mod=MODULES)
    result = pytester.runpytest("--ltconform", "targets_mod.Good", "--ltconform", "targets_mod:broken_factory",
                                "--collect-only", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        "ERROR: target 2 of 2 (targets_mod:broken_factory): --ltconform 'targets_mod:broken_factory': calling "
        "broken_factory() raised ValueError: checkpoint path not set (at *targets_mod.py:*"])
    assert "Traceback" not in result.stderr.str()


def test_a_bad_init_in_conftest_names_the_declaration(pytester):
    pytester.makepyfile(targets_mod=MODULES)
    pytester.makeconftest("from pytest_ltconform import Target\n\ndef pytest_ltconform_targets(config):\n"
                          "    return [Target('targets_mod.Sized', init={'width': 4})]\n")
    result = pytester.runpytest("--collect-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: Target at *conftest.py:4 'targets_mod.Sized': init={'width': 4} does not "
                                 "fit Sized(hidden, lr=0.1): 'width' is not a parameter; 'hidden' is required but "
                                 "not given.*"])


# -- the summary and the report, from records ---------------------------------------------------------

def _rec(target, contract, outcome):
    return {"target": target, "contract": contract, "strategy": "ddp", "outcome": outcome, "message": f"{contract} msg",
            "summary": f"{contract} summary", "block": f"{target} {contract} evidence", "partial": False}


def test_summary_has_a_block_per_target_and_names_the_target_of_each_failure():
    from pytest_ltconform import report

    results = [_rec("m1", "sync-dist", "passed"), _rec("m2", "sync-dist", "failed"),
               _rec("m2", "spawn-safety", "error")]
    text = report.summary_text(results, width=60, color=False)
    lines = [line.rstrip() for line in text.splitlines()]
    assert lines[:4] == ["target m1", "contract    ddp", "─" * 18, "sync-dist   passed"]
    assert lines[5:10] == ["target m2", "contract       ddp", "─" * 21, "sync-dist      failed", "spawn-safety   error"]
    # A failure's block is in pytest's FAILURES: here one line names it (the block only for --tb=no).
    assert "failed (each block is in FAILURES above)" in lines[10]
    assert lines[11] == "m2::sync-dist[ddp]: sync-dist summary"
    assert "m2 sync-dist evidence" not in text
    assert lines[-1] == "m2::spawn-safety[ddp]: spawn-safety summary"
    one = report.summary_text([_rec("m1", "sync-dist", "failed")], width=60, color=False, blocks=True).splitlines()
    assert one[0] == "target m1" and "m1::" not in one[4] and "sync-dist[ddp]" in one[4]
    assert one[5] == "m1 sync-dist evidence"


def test_a_green_run_shows_one_line_per_advisory_and_its_evidence_only_when_asked():
    from pytest_ltconform import report

    results = [_rec("m1", "sync-dist", "passed"), _rec("m1", "memory", "advisory")]
    lines = [line.rstrip() for line in report.summary_text(results, width=80, color=False).splitlines()]
    assert "advisory (the evidence: -rA, -vv or the JSON report)" in lines[-2]
    assert lines[-1] == "memory[ddp]: memory summary"
    assert "m1 memory evidence" not in "\n".join(lines)
    detailed = report.summary_text(results, width=80, color=False, details=True)  # -vv
    assert "m1 memory evidence" in detailed and "memory[ddp]: memory summary" not in detailed


def test_report_lists_each_target_with_its_records(tmp_path, targets_mod):
    from pytest_ltconform import report
    from pytest_ltconform.target import validation as target_validation

    first = target_validation.validate("targets_mod.Good", "targets_mod.Data", "targets_mod:trainer_ok", id="first")
    second = target_validation.validate("targets_mod.Sized", init={"hidden": 2, "lr": 0.5}, trainer={"max_epochs": 1},
                             id="second")
    results = [_rec("first", "sync-dist", "passed"), _rec("second", "sync-dist", "failed")]
    path = tmp_path / "r.json"
    report.write_json(str(path), "targets_mod.Good", 2, results, targets=[first, second], cold_starts=1)
    doc = json.loads(path.read_text())
    assert list(doc) == ["target", "world_size", "versions", "results", "targets", "cold_starts", "not_run",
                         "interrupted", "exitstatus", "runs", "imports"]
    assert (doc["target"], doc["results"], doc["cold_starts"]) == ("targets_mod.Good", results, 1)
    assert doc["targets"] == [
        {"id": "first", "model": "targets_mod.Good", "datamodule": "targets_mod.Data",
         "trainer": "targets_mod:trainer_ok", "init": None, "results": results[:1]},
        {"id": "second", "model": "targets_mod.Sized", "datamodule": None, "trainer": {"max_epochs": 1},
         "init": {"hidden": 2, "lr": 0.5}, "results": results[1:]}]


# -- one session, three targets, one world ------------------------------------------------------------

WIDE = '''

class Wide(Model):
    """The same module, built with a width its constructor needs."""

    def __init__(self, hidden):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3))
'''

THREE = '''
from pytest_ltconform import Target

def pytest_ltconform_targets(config):
    return [Target("b/model.py:Wide", init={"hidden": 32}, trainer={"max_epochs": 2}, id="f1")]
'''


LEAKS = """
import torch
from lightning.pytorch.demos.boring_classes import BoringModel


class Leaks(BoringModel):
    def training_step(self, batch, batch_idx):
        torch.distributions.Distribution.set_default_validate_args(False)  # process-wide
        return super().training_step(batch, batch_idx)


class Sees(BoringModel):
    def training_step(self, batch, batch_idx):
        if not torch.distributions.Distribution._validate_args:
            raise RuntimeError("validate_args is off: another module's run switched it off")
        return super().training_step(batch, batch_idx)
"""


def test_a_target_never_runs_in_ranks_another_target_changed(pytester, no_leftover_ranks):
    """A target's run switches a library flag off process-wide; the next target's ranks are fresh,
    so it sees the library's default, not the flag the first one left."""
    pytester.makepyfile(leaks=LEAKS)
    report = pytester.path / "r.json"
    result = pytester.runpytest_subprocess(
        "--ltconform", "leaks.Leaks", "--ltconform", "leaks.Sees", "--ltconform-strategies", "ddp",
        "-m", "ltconform_cpu", "-k", "sync-dist", "--ltconform-report", str(report), "-p", "no:cacheprovider", "-rA")
    out = result.stdout.str()
    assert result.parseoutcomes().get("passed") == 2 and "failed" not in result.parseoutcomes(), out[-4000:]
    assert "validate_args is off" not in out
    assert json.loads(report.read_text())["cold_starts"] == 2


def test_three_targets_share_one_world(pytester, no_leftover_ranks):
    """Lightning's BoringModel, a conforming corpus case (a/model.py) and a violating one
    (b/model.py, the same basename, built with init= and a trainer dict from conftest.py): each
    target is judged on its own module, in ranks of its own: one world, three rank generations."""
    for folder, name in (("a", "ok_linear_metrics_summed_per_batch.py"), ("b", "per_batch_f1_value_logged.py")):
        (pytester.path / folder).mkdir()
        shutil.copy(CONFORMANCE / "sync-dist" / name, pytester.path / folder / "model.py")
    with open(pytester.path / "b" / "model.py", "a") as fh:
        fh.write(WIDE)
    pytester.makeconftest(THREE)
    report = pytester.path / "r.json"
    linear = "a/model.py:Model trainer=a/model.py:trainer_kwargs"
    result = pytester.runpytest_subprocess(
        "--ltconform", BORING, "--ltconform", linear, "--ltconform-strategies", "ddp", "-m", "ltconform_cpu",
        "-k", "sync-dist", "--ltconform-report", str(report), "-p", "no:cacheprovider", "-rA")
    out = result.stdout.str()
    assert result.parseoutcomes() == {"passed": 2, "failed": 1, "deselected": result.parseoutcomes()["deselected"]}, \
        out[-4000:]
    result.stdout.fnmatch_lines([f"PASSED ltconform::{BORING}::sync-dist[[]ddp[]]*",
                                 f"PASSED ltconform::{linear}::sync-dist[[]ddp[]]*",
                                 "FAILED ltconform::f1::sync-dist[[]ddp[]] - [[]sync-dist[]] FAILED*"])
    # The failure's block once, in FAILURES; the summary names the item with its target in one line.
    result.stdout.fnmatch_lines(["*FAILURES*", "*f1::sync-dist[[]ddp[]]*",
                                 "*'val_f1' logged via log_dict from the per-batch return value of MulticlassF1Score*",
                                 "*rank 0 at b/model.py:39 (Model.validation_step)*",
                                 "*ltconform summary*", f"target {BORING}", "contract *ddp*", "sync-dist *passed*",
                                 f"target {linear}", "contract *ddp*", "sync-dist *passed*",
                                 "target f1", "contract *ddp*", "sync-dist *failed*",
                                 "f1::sync-dist[[]ddp[]]: 'val_f1' logged via log_dict*"])
    body = out.split("short test summary info")[0]  # on CI pytest's short summary repeats the message
    assert body.count("rank 0 at b/model.py:39 (Model.validation_step)") == 1, out[-4000:]
    doc = json.loads(report.read_text())
    assert doc["target"] == BORING and doc["cold_starts"] == 3
    assert [(t["id"], t["model"], t["trainer"], t["init"]) for t in doc["targets"]] == [
        (BORING, BORING, None, None), (linear, "a/model.py:Model", "a/model.py:trainer_kwargs", None),
        ("f1", "b/model.py:Wide", {"max_epochs": 2}, {"hidden": 32})]
    assert [[(r["target"], r["contract"], r["outcome"]) for r in t["results"]] for t in doc["targets"]] == [
        [(BORING, "sync-dist", "passed")], [(linear, "sync-dist", "passed")], [("f1", "sync-dist", "failed")]]
    assert [r["target"] for r in doc["results"]] == [BORING, linear, "f1"]


# -- Lightning namespaces and releases (docs/ci.md, Versions) ----------------------------------------

MIXED = '''
import lightning.pytorch as L
import pytorch_lightning as pl
from lightning.pytorch.demos.boring_classes import BoringModel, BoringDataModule
from pytorch_lightning.demos.boring_classes import BoringModel as PlBoringModel

def pl_callback():
    return {"callbacks": [pl.callbacks.ModelCheckpoint(monitor=None)]}

def lightning_strategy():
    return {"strategy": L.strategies.DDPStrategy()}

def pl_environment():
    import lightning_fabric
    return {"plugins": [lightning_fabric.plugins.environments.LightningEnvironment()]}

def lightning_environment():
    import lightning.fabric
    return {"plugins": [lightning.fabric.plugins.environments.LightningEnvironment()]}
'''


@pytest.fixture
def mixed_mod(tmp_path, monkeypatch):
    (tmp_path / "mixed_mod.py").write_text(MIXED)
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "mixed_mod", raising=False)


@pytest.mark.parametrize("model, trainer, name, source, where", [
    ("mixed_mod.BoringModel", "mixed_mod:pl_callback", "ModelCheckpoint", "pytorch_lightning",
     "{}.callbacks.model_checkpoint"),
    ("mixed_mod.PlBoringModel", "mixed_mod:lightning_strategy", "DDPStrategy", "lightning.pytorch",
     "{}.strategies.ddp"),
    ("mixed_mod.BoringModel", "mixed_mod:pl_environment", "LightningEnvironment", "pytorch_lightning",
     "{}.plugins.environments.lightning"),
    ("mixed_mod.PlBoringModel", "mixed_mod:lightning_environment", "LightningEnvironment", "lightning.pytorch",
     "{}.plugins.environments.lightning"),
])
def test_a_trainer_object_of_the_other_namespace_is_refused_at_start(mixed_mod, model, trainer, name, source, where):
    """A callback, strategy or plugin of the other Lightning package than the module's: the item's
    Trainer would reject it at fit, on every rank; it is said once, at start, with the import to use."""
    from pytest_ltconform.target import spec, validation

    module_ns = "pytorch_lightning" if "PlBoring" in model else "lightning.pytorch"
    fabric = "plugins" in where  # environments live in the fabric package of each namespace

    def twin(ns):
        return where.format({"lightning.pytorch": "lightning.fabric" if fabric else "lightning.pytorch",
                             "pytorch_lightning": "lightning_fabric" if fabric else "pytorch_lightning"}[ns])

    with pytest.raises(spec.TargetError) as info:
        validation.validate(model, trainer=trainer)
    message = str(info.value)
    assert message.startswith(f"--ltconform-trainer {trainer!r} (the Trainer kwargs of {model!r}): "), message
    assert f"{name} comes from {twin(source)}" in message and f"of the {source} package" in message
    assert f"the module derives from {module_ns}" in message and f"Import {name} from {twin(module_ns)}" in message
    # The same kwargs with the module's own package pass.
    same = {"pytorch_lightning": "mixed_mod.PlBoringModel", "lightning.pytorch": "mixed_mod.BoringModel"}[source]
    assert validation.validate(same, trainer=trainer).namespace == source


def test_a_datamodule_of_the_other_namespace_is_refused_at_start(mixed_mod):
    from pytest_ltconform.target import spec, validation

    with pytest.raises(spec.TargetError, match=r"--ltconform-datamodule 'mixed_mod.BoringDataModule' derives from "
                                                 r"lightning.pytorch but the module 'mixed_mod.PlBoringModel' from "
                                                 r"pytorch_lightning: a Trainer of one namespace rejects"):
        validation.validate("mixed_mod.PlBoringModel", datamodule="mixed_mod.BoringDataModule")


@pytest.mark.parametrize("module, dist", [("lightning", "lightning"), ("pytorch_lightning", "pytorch-lightning")])
def test_a_lightning_older_than_the_floor_is_refused_at_start(mixed_mod, monkeypatch, module, dist):
    """Below the floor the plugin is not verified (Lightning 2.2 refuses FSDP on CPU, which the
    items would blame on the module): one start-up error naming the release and the install."""
    from pytest_ltconform import releases
    from pytest_ltconform.target import spec, validation

    model = "mixed_mod.PlBoringModel" if module == "pytorch_lightning" else "mixed_mod.BoringModel"
    validation.validate(model)  # the installed release is supported
    __import__(module)
    monkeypatch.setattr(sys.modules[module], "__version__", "2.3.3")
    with pytest.raises(spec.TargetError) as info:
        validation.validate(model)
    floor = releases.text(releases.FLOOR)
    assert str(info.value) == (
        f"--ltconform {model!r} derives from {'lightning.pytorch' if module == 'lightning' else module}: {dist} 2.3.3 "
        f"is older than {floor}, the oldest release pytest-ltconform is verified on (docs/ci.md, Versions). "
        f"Install {dist}>={floor} next to the plugin, e.g. pip install '{dist}>={floor}'.")


def test_releases_read_and_compare_versions():
    from pytest_ltconform import releases

    assert releases.parse("2.5.1.post0") == (2, 5, 1) and releases.parse("2.6") == (2, 6, 0)
    assert releases.parse(None) is None and releases.parse("dev") is None
    assert releases.before("2.6.0", releases.WRAPPER_FORWARDS_SET_EPOCH)
    assert not releases.before("2.6.1", releases.WRAPPER_FORWARDS_SET_EPOCH)
    assert not releases.before(None, releases.FLOOR)  # unknown: the rules' release
    import lightning

    assert releases.of_namespace("lightning.pytorch") == lightning.__version__
    assert releases.of_object(lightning.pytorch.Trainer) is None  # a class object: type(obj) is type
    assert releases.of_object(lightning.pytorch.demos.boring_classes.BoringModel()) == lightning.__version__
