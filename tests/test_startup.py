"""Start-up behaviour: options, ini precedence, markers, bad targets, no heavy imports.

These run pytest in-process (``pytester.runpytest``) or in a subprocess; none starts a world.
"""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]


def test_plain_pytest_imports_no_torch_or_lightning(pytester):
    pytester.makepyfile(
        """
        import sys
        def test_nothing_heavy():
            heavy = [m for m in ("torch", "lightning", "pytorch_lightning") if m in sys.modules]
            assert not heavy, heavy
        """
    )
    result = pytester.runpytest_subprocess()  # the plugin loads through its entry point
    result.assert_outcomes(passed=1)


def test_markers_registered_under_strict_markers(pytester):
    pytester.makepyfile(
        """
        import pytest
        @pytest.mark.ltconform
        @pytest.mark.ltconform_cpu
        @pytest.mark.ltconform_gpu
        @pytest.mark.ltconform_multinode
        @pytest.mark.ltconform_deepspeed
        def test_marked():
            pass
        """
    )
    result = pytester.runpytest("--strict-markers")
    result.assert_outcomes(passed=1)
    listing = pytester.runpytest("--markers")
    listing.stdout.fnmatch_lines(["@pytest.mark.ltconform_gpu:*CUDA*"])


SETTINGS_TEST = """
from pytest_ltconform.controller import SETTINGS_KEY
def test_settings(pytestconfig):
    s = pytestconfig.stash[SETTINGS_KEY]
    print("SETTINGS", s.world_size, s.timeout_s, s.strategies)
"""


def test_ini_values_apply_and_command_line_wins(pytester):
    pytester.makeini("[pytest]\nltconform_world_size = 3\nltconform_timeout = 45\nltconform_strategies = ddp\n")
    pytester.makepyfile(SETTINGS_TEST)
    result = pytester.runpytest("-s")
    result.stdout.fnmatch_lines(["*SETTINGS 3 45.0 ('ddp',)"])
    result = pytester.runpytest("-s", "--ltconform-world-size", "4", "--ltconform-timeout", "30")
    result.stdout.fnmatch_lines(["*SETTINGS 4 30.0 ('ddp',)"])


@pytest.mark.parametrize(
    "ini, args, message",
    [
        ("ltconform_world_size = two", [], "*ini option 'ltconform_world_size'*expected a whole number*'two'*"),
        ("", ["--ltconform-timeout", "-3"], "*--ltconform-timeout: the timeout must be positive*"),
        ("", ["--ltconform-timeout", "nan"], "*--ltconform-timeout: expected a finite number of seconds, got 'nan'*"),
        ("ltconform_target =", [], "*ini option 'ltconform_target' in * is empty, so no target would be checked*"),
        ("", ["--ltconform-require", "tpu"], "*--ltconform-require: unknown value(s) 'tpu'; choose from cpu, gpu*"),
        # An empty value is refused, not read as "all" or "none".
        ("", ["--ltconform", ""], "ERROR: --ltconform '': empty target. Pass pkg.mod.Class, pkg.mod:factory or "
         "path/to/file.py:Name*"),
        ("ltconform_strategies = fsdp", ["--ltconform-strategies", ""], "ERROR: --ltconform-strategies: empty value "
         "''. Name one or more of ddp, fsdp, deepspeed (comma-separated), or leave the option out for its default."),
        ("ltconform_strategies = ,", [], "ERROR: ini option 'ltconform_strategies' in *: no value in ','; choose "
         "from ddp, fsdp, deepspeed."),
        # One rank cannot show a cross-rank fault: refused, not judged as passes.
        ("", ["--ltconform-world-size", "1"], "ERROR: --ltconform-world-size: a one-rank world cannot show a "
         "cross-rank fault * so every contract would pass without comparing anything. Use "
         "--ltconform-world-size 2 (the default) or more."),
        ("ltconform_world_size = 1", [], "ERROR: ini option 'ltconform_world_size' in *: a one-rank world cannot*"),
        # A misspelt key of ours is an error with the right key, not pytest's warning and a green job.
        ("ltconform_targt = m.Model", [], "ERROR: ini option 'ltconform_targt' (did you mean 'ltconform_target'?) "
         "in *: pytest-ltconform has no such option, so it would be ignored. Its options are ltconform_target, *"),
        ("ltconfrom_strategies = ddp", [], "ERROR: ini option 'ltconfrom_strategies' (did you mean "
         "'ltconform_strategies'?) in *"),
        # Every misspelt key in one run, not one per run.
        ("ltconform_targt = m.Model\nltconform_timeuot = 9", [], "ERROR: ini options 'ltconform_targt' (did you mean "
         "'ltconform_target'?), 'ltconform_timeuot' (did you mean 'ltconform_timeout'?) in *: pytest-ltconform has "
         "no such option, so they would be ignored.*"),
        # A value given with -o is named as such, not as the ini file's.
        ("", ["-o", "ltconform_world_size=1"], "ERROR: -o ltconform_world_size=...: a one-rank world cannot*"),
        ("ltconform_launcher = vfork", [], "ERROR: ini option 'ltconform_launcher' in *: unknown launcher 'vfork'; "
         "choose from fork, spawn (fork, the default, forks ranks from one parent*"),
        ("", ["--ltconform-launcher", "vfork"], "ERROR: --ltconform-launcher: unknown launcher 'vfork'; choose from "
         "fork, spawn*"),
        # A strategy named twice is refused, not run twice or merged without a word.
        ("", ["--ltconform-strategies", "ddp,fsdp,ddp"], "ERROR: --ltconform-strategies: 'ddp' named more than once "
         "in 'ddp,fsdp,ddp'; name each once (choose from ddp, fsdp, deepspeed)."),
        ("ltconform_require = cpu, cpu", [], "ERROR: ini option 'ltconform_require' in *: 'cpu' named more than once*"),
        # Every bad input of one run in one paragraph, numbered, each with where it came from.
        ("ltconform_launcher = vfork", ["--ltconform-world-size", "1", "--ltconform-timeout", "3",
                                        "--ltconform-strategies", "ddp,ddp"],
         "ERROR: 4 inputs need fixing before anything runs: (1) --ltconform-world-size: a one-rank world cannot show "
         "* (2) --ltconform-timeout: 3 s is shorter than a contract run can take;* (3) --ltconform-strategies: 'ddp' "
         "named more than once in 'ddp,ddp';* (4) ini option 'ltconform_launcher' in *: unknown launcher 'vfork';*"),
        ("ltconform_seeding = random", [], "ERROR: ini option 'ltconform_seeding' in *: unknown seeding 'random'; "
         "choose from both, same, per-rank (both, the default, judges draws that must agree*"),
        ("", ["--ltconform-seeding", "each"], "ERROR: --ltconform-seeding: unknown seeding 'each'; choose from both, "
         "same, per-rank*"),
    ],
)
def test_bad_settings_name_where_they_came_from(pytester, ini, args, message):
    pytester.makeini(f"[pytest]\n{ini}\n")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_misspelt_key_in_pyproject_is_refused_and_other_keys_are_left_to_pytest(pytester):
    pytester.makepyprojecttoml('[tool.pytest.ini_options]\nltconform_strategy = "ddp"\n')
    pytester.makepyfile("def test_user():\n    pass\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: ini option 'ltconform_strategy' (did you mean 'ltconform_strategies'?) in "
                                 "*pyproject.toml: pytest-ltconform has no such option, so it would be ignored.*"])
    # A key far from ours is pytest's to warn about (and to refuse under --strict-config).
    pytester.makepyprojecttoml('[tool.pytest.ini_options]\ntimeout_method = "thread"\n')
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)


TARGETS = '''
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

class ZeroBatches(Good):
    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(3, 2)), batch_size=4, drop_last=True)

class NeedsSetup(Good):
    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=2)  # made in setup(): not measured at start

class NoData(L.LightningModule):
    def training_step(self, batch, batch_idx):
        return None

class NeedsArgs(Good):
    def __init__(self, hidden):
        super().__init__()

class NotAModule:
    pass

def broken_factory():
    raise ValueError("checkpoint path not set")

def trainer_list():
    return ["not", "a", "dict"]

def trainer_typo():
    return {"max_epoch": 3}

class Data(L.LightningDataModule):
    pass

class DataNeedsRoot(L.LightningDataModule):
    def __init__(self, root):
        super().__init__()
'''


@pytest.mark.parametrize(
    "model, trainer, expected",
    [
        ("no_such_pkg.Model", None, "--ltconform 'no_such_pkg.Model': cannot import module 'no_such_pkg'"),
        ("targets_mod.Goood", None, "'Goood'. Did you mean 'Good'? LightningModules defined there: Good"),
        ("targets_mod.py", None, "a file target needs the object's name after a colon, e.g. targets_mod.py:Model"),
        ("targets_mod.NotAModule", None, "is a class but not a LightningModule subclass"),
        ("targets_mod:broken_factory", None, "broken_factory() raised ValueError: checkpoint path not set (at "),
        ("targets_mod.NoData", None, "no train_dataloader is defined on NoData"),
        ("targets_mod.ZeroBatches", None, "--ltconform 'targets_mod.ZeroBatches': ZeroBatches.train_dataloader() "
         "returned an empty DataLoader (3 sample(s), batch_size=4, drop_last=True), so no training step would "
         "run and every contract would pass having compared nothing. Give it at least one batch per rank."),
        ("targets_mod.NeedsArgs", None, "cannot be constructed without arguments (__init__ requires hidden). "
         "Write a zero-argument factory that returns a configured instance and pass it as "
         "targets_mod:make_needs_args, or declare the target in conftest.py as "
         "pytest_ltconform.Target('targets_mod.NeedsArgs', init={'hidden': ...})"),
        ("missing/file.py:Model", None, "the file 'missing/file.py' does not exist"),
        ("targets_mod.Good", "targets_mod:trainer_list", "expected a dict of Trainer kwargs"),
        ("targets_mod.Good", "targets_mod:trainer_typo", "max_epoch is not a Trainer argument of lightning.pytorch; "
         "did you mean 'max_epochs' for 'max_epoch'?"),
        ("targets_mod.Good", "targets_mod:nope", "--ltconform-trainer 'targets_mod:nope': module 'targets_mod' has no "
         "attribute 'nope'. Dicts and functions defined there: broken_factory, trainer_list, trainer_typo."),
        ("targets_mod.Good", "targets_mod:trainer_typ", "'trainer_typ'. Did you mean 'trainer_typo'? Dicts and "
         "functions defined there: "),
        # A syntax error names its own file and line (its traceback has no frame of the user's).
        ("broken_syntax.py:Model", None, "--ltconform 'broken_syntax.py:Model': 'broken_syntax' cannot be imported: "
         "SyntaxError at "),
    ],
)
def test_bad_targets_name_the_input_and_the_fix(tmp_path, monkeypatch, model, trainer, expected):
    from pytest_ltconform.target import spec as target_spec
    from pytest_ltconform.target import validation as target_validation

    (tmp_path / "targets_mod.py").write_text(TARGETS)
    (tmp_path / "broken_syntax.py").write_text("import torch\nclass Model(\n")
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(__import__("sys").modules, "targets_mod", raising=False)
    with pytest.raises(target_spec.TargetError) as info:
        target_validation.validate(model, None, trainer)
    assert expected in str(info.value)
    assert "(at ?)" not in str(info.value)
    if model.startswith("broken_syntax"):
        assert f"{tmp_path / 'broken_syntax.py'}:2: '(' was never closed. Fix the syntax there." in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "datamodule, expected",
    [
        ("targets_mod.Dta", "--ltconform-datamodule 'targets_mod.Dta': module 'targets_mod' has no attribute 'Dta'. "
         "Did you mean 'Data'? LightningDataModules defined there: Data, DataNeedsRoot."),
        ("targets_mod.DataNeedsRoot", "DataNeedsRoot() cannot be constructed without arguments (__init__ requires "
         "root). Write a zero-argument factory that returns a configured instance and pass it as "
         "targets_mod:make_data_needs_root."),
    ],
)
def test_bad_datamodule_targets_name_the_candidates(tmp_path, monkeypatch, datamodule, expected):
    from pytest_ltconform.target import spec as target_spec
    from pytest_ltconform.target import validation as target_validation

    (tmp_path / "targets_mod.py").write_text(TARGETS)
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.delitem(__import__("sys").modules, "targets_mod", raising=False)
    with pytest.raises(target_spec.TargetError) as info:
        target_validation.validate("targets_mod.Good", datamodule)
    assert str(info.value).endswith(expected)


def test_a_loader_that_needs_setup_is_left_to_the_ranks(tmp_path, monkeypatch):
    from pytest_ltconform.target import validation as target_validation

    (tmp_path / "targets_mod.py").write_text(TARGETS)
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.delitem(__import__("sys").modules, "targets_mod", raising=False)
    assert target_validation.validate("targets_mod.NeedsSetup").model_name == "NeedsSetup"


def test_an_empty_training_loader_stops_the_session_instead_of_passing(pytester):
    pytester.makepyfile(targets_mod=TARGETS)
    result = pytester.runpytest_subprocess("--ltconform", "targets_mod.ZeroBatches", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --ltconform 'targets_mod.ZeroBatches': ZeroBatches.train_dataloader() "
                                 "returned an empty DataLoader (3 sample(s), batch_size=4, drop_last=True)*"])
    assert "passed" not in result.stdout.str()


def test_bad_targets_and_bad_options_are_named_together_in_one_paragraph(pytester):
    """Every target is validated even when another, or an option, is bad: one run names them all."""
    pytester.makepyfile(targets_mod=TARGETS)
    result = pytester.runpytest_subprocess("--ltconform", "targets_mod:broken_factory", "--ltconform",
                                           "targets_mod.Missing", "--ltconform", "targets_mod.Good",
                                           "--ltconform-timeout", "3", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: 3 inputs need fixing before anything runs: (1) --ltconform-timeout: 3 s is "
                                 "shorter than a contract run can take;* (2) target 1 of 3 (targets_mod:broken_factory)"
                                 ": --ltconform 'targets_mod:broken_factory': calling broken_factory() raised "
                                 "ValueError: checkpoint path not set* (3) target 2 of 3 (targets_mod.Missing): "
                                 "--ltconform 'targets_mod.Missing': *"])
    assert "Traceback" not in result.stderr.str()


def test_a_target_path_with_spaces_is_taken_as_written_or_quoted():
    from pytest_ltconform.settings import parse_target

    found = parse_target("my models/model.py:Model trainer=my models/train.py:kwargs id=small", "--ltconform")
    assert (found.model, found.trainer, found.id) == ("my models/model.py:Model", "my models/train.py:kwargs", "small")
    found = parse_target("'my models/model.py:Model' datamodule=\"my data/dm.py:DM\"", "--ltconform")
    assert (found.model, found.datamodule) == ("my models/model.py:Model", "my data/dm.py:DM")
    # A stray word after a target that names no file is still reported, not glued to the target.
    with pytest.raises(pytest.UsageError, match="'extra' is not KEY=VALUE with a known key"):
        parse_target("pkg.Model extra", "--ltconform")
    with pytest.raises(pytest.UsageError, match=r"is not KEY=VALUE with a known key; .* \(a file path may hold spaces: "
                                                r"it is taken as written, or in quotes, when it ends in \.py:Name\)"):
        parse_target("my models/model.py:Model extra", "--ltconform")


def test_a_file_target_in_a_folder_with_a_space_is_collected(pytester):
    folder = pytester.path / "my models"
    folder.mkdir()
    (folder / "targets mod.py").write_text(TARGETS)
    result = pytester.runpytest_subprocess("--ltconform", "my models/targets mod.py:Good", "--collect-only", "-q",
                                           "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines(["ltconform::my models/targets mod.py:Good::sync-dist[[]ddp[]]"])


def test_deselecting_every_contract_item_of_a_named_target_is_said_and_imports_nothing(pytester):
    pytester.makepyfile(targets_mod=TARGETS)
    pytester.makeconftest(HEAVY_AFTER_VALIDATION)
    result = pytester.runpytest_subprocess("-m", "not ltconform", "--ltconform", "targets_mod:Good", "-s",
                                           "-p", "no:cacheprovider")
    line = ("ltconform: -m 'not ltconform' deselects every contract item, so targets_mod:Good is not checked in this "
            "run (nothing of it was imported); drop that -m, or select the items with -m ltconform")
    assert result.stdout.str().count(line) == 2, result.stdout.str()  # in the header and at the end
    result.stdout.fnmatch_lines(["LOADED IN PYTEST: nothing"])
    assert not (pytester.path / "imported-with.txt").exists()  # the target was not even imported elsewhere
    # A -m that keeps some contract items (a tier) selects them, with no such line.
    kept = pytester.runpytest_subprocess("-m", "not ltconform_deepspeed", "--ltconform", "targets_mod:Good",
                                         "--collect-only", "-q", "-p", "no:cacheprovider")
    assert "deselects every contract item" not in kept.stdout.str()
    kept.stdout.fnmatch_lines(["ltconform::targets_mod:Good::sync-dist[[]ddp[]]"])


def test_bad_target_fails_the_session_at_start_without_traceback(pytester):
    pytester.makepyfile(targets_mod=TARGETS)
    result = pytester.runpytest_subprocess("--ltconform", "targets_mod:broken_factory", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --ltconform 'targets_mod:broken_factory': calling broken_factory() raised "
                                 "ValueError: checkpoint path not set (at *targets_mod.py:*"])
    assert "Traceback" not in result.stderr.str()


HEAVY_AFTER_VALIDATION = """
import sys


def pytest_collection_finish(session):
    loaded = sorted({"torch", "lightning", "deepspeed", "targets_mod"} & set(sys.modules))
    print("LOADED IN PYTEST:", ", ".join(loaded) or "nothing", flush=True)
"""


@pytest.mark.parametrize("launcher, conftest_imports, loaded", [
    ("fork", "", "nothing"),
    ("spawn", "", "deepspeed, lightning, torch"),
    ("fork", "import lightning.pytorch\n", "deepspeed, lightning, torch"),
])
def test_pytest_validates_a_target_without_importing_it_when_ranks_are_forked(pytester, launcher, conftest_imports,
                                                                              loaded):
    """Under the fork launcher the target is imported and built in a process forked from the
    ranks' parent: pytest itself imports neither torch, Lightning nor the user's module to check
    it. Under spawn, or when a conftest imported Lightning already, it validates in its own
    process, as before (the user's module forgotten afterwards)."""
    pytester.makepyfile(targets_mod=TARGETS + SAYS_WHAT_WAS_IMPORTED)
    pytester.makeconftest(conftest_imports + HEAVY_AFTER_VALIDATION)
    result = pytester.runpytest_subprocess("--ltconform", "targets_mod:Good", "--collect-only", "-q", "-s",
                                           "--ltconform-launcher", launcher, "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.stdout.fnmatch_lines(["ltconform::targets_mod:Good::sync-dist[[]ddp[]]", f"LOADED IN PYTEST: {loaded}"])
    if loaded == "nothing":  # the forked check: the parent imported Lightning alone, not the ranks' rest
        assert (pytester.path / "imported-with.txt").read_text().split("\n")[:-1] == ["lightning"]


SAYS_WHAT_WAS_IMPORTED = """

import sys as _sys

with open("imported-with.txt", "a") as _fh:
    _fh.write(", ".join(sorted({"lightning", "deepspeed", "pytest_ltconform.harness"} & set(_sys.modules))) + "\\n")
"""


DIES_AT_IMPORT = """
import os

os._exit(3)
"""


def test_a_target_whose_import_kills_its_process_is_a_usage_error_not_a_dead_pytest(pytester):
    pytester.makepyfile(dies_mod=DIES_AT_IMPORT)
    result = pytester.runpytest_subprocess("--ltconform", "dies_mod:Model", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --ltconform 'dies_mod:Model': the process importing and building the "
                                 "target died (exit status 3) before it could report*"])


TRAINERS = """
from lightning.pytorch.callbacks import ModelCheckpoint

strategy_int = {"strategy": 42}
strategy_unknown = {"strategy": "horovod", "max_epochs": 2}
epochs_text = {"max_epochs": "ten"}
callbacks_text = {"callbacks": "ModelCheckpoint"}
no_accumulation = {"accumulate_grad_batches": 0}
precision_unknown = {"precision": "fp8-magic"}
no_train_batches = {"limit_train_batches": 0}
negative_epochs = {"max_epochs": -5}

def checkpoint_off():
    return {"callbacks": [ModelCheckpoint(monitor="loss")], "enable_checkpointing": False}

def production():
    return {"accelerator": "gpu", "devices": 8, "strategy": "ddp_find_unused_parameters_true", "max_epochs": 100,
            "precision": "bf16-mixed", "accumulate_grad_batches": 2, "gradient_clip_val": 1.0,
            "callbacks": [ModelCheckpoint(dirpath="checkpoints/", monitor="loss")]}
"""

WHERE = "ERROR: trainer= of --ltconform 'trainers:{}' (the Trainer kwargs of 'targets_mod.Good'): "


@pytest.mark.parametrize("kwargs, message", [
    ("strategy_int", "strategy=42 is not what Trainer(strategy=...) takes: lightning.pytorch.Trainer declares a str "
     "or a Strategy. Give strategy such a value, or leave it out."),
    ("strategy_unknown", "strategy='horovod' is not a strategy Lightning knows (its StrategyRegistry has no such "
     "name). Give a registered name (ddp, ddp_find_unused_parameters_true, fsdp, deepspeed_stage_2, ... * in all) or "
     "a Strategy instance such as DDPStrategy(...)."),
    ("epochs_text", "max_epochs='ten' is not what Trainer(max_epochs=...) takes: lightning.pytorch.Trainer declares "
     "an int or None. Give max_epochs such a value, or leave it out."),
    ("callbacks_text", "callbacks='ModelCheckpoint' is not what Trainer(callbacks=...) takes: * declares a list of "
     "Callback or a Callback or None.*"),
    ("no_accumulation", "accumulate_grad_batches=0: Lightning refuses it as an accumulation factor (Accumulation "
     "factor should be an int greater than 0. Got [[]0[]].) and its training loop divides by it. Use 1 for no "
     "accumulation, or the number of batches per optimizer step."),
    ("precision_unknown", "precision='fp8-magic' is not what Trainer(precision=...) takes: * declares one of 64, 32, "
     "16, 'transformer-engine', *'bf16-mixed'* or None.*"),
    ("no_train_batches", "limit_train_batches=0 trains on no batch, so no contract could see a training step and "
     "every item would pass having compared nothing. Leave it out *"),
    ("negative_epochs", "Lightning refuses max_epochs=-5: building a Trainer with it raised "
     "MisconfigurationException: `max_epochs` must be a non-negative integer or -1. You passed in -5. Fix the value: "
     "every rank builds its Trainer from the same kwargs and would stop there."),
    ("checkpoint_off", "Lightning refuses these Trainer kwargs together (callbacks, enable_checkpointing): building "
     "a Trainer with it raised MisconfigurationException: Trainer was configured with `enable_checkpointing=False` "
     "but found `ModelCheckpoint` in callbacks list. Fix the combination: *"),
])
def test_trainer_kwargs_lightning_refuses_are_named_with_the_fix(tmp_path, monkeypatch, kwargs, message):
    # In this process: a Trainer built inside an in-process pytester run imports torch modules that
    # the run's sys.modules snapshot then drops, and a later run crashes re-importing them.
    from fnmatch import fnmatch

    from pytest_ltconform.target import spec as target_spec
    from pytest_ltconform.target import validation as target_validation

    (tmp_path / "targets_mod.py").write_text(TARGETS)
    (tmp_path / "trainers.py").write_text(TRAINERS)
    monkeypatch.syspath_prepend(tmp_path)
    for name in ("targets_mod", "trainers"):
        monkeypatch.delitem(__import__("sys").modules, name, raising=False)
    with pytest.raises(target_spec.TargetError) as info:
        target_validation.validate("targets_mod.Good", trainer=f"trainers:{kwargs}", options=(
            "--ltconform", "--ltconform-datamodule", "trainer= of --ltconform"))
    assert fnmatch(f"ERROR: {info.value}", WHERE.format(kwargs) + message), str(info.value)


def test_production_trainer_kwargs_pass_the_check_and_leave_no_files(pytester):
    pytester.makepyfile(targets_mod=TARGETS, trainers=TRAINERS)
    result = pytester.runpytest_subprocess("--ltconform", "targets_mod.Good trainer=trainers:production",
                                           "--collect-only", "-q", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["ltconform::targets_mod.Good trainer=trainers:production::sync-dist[[]ddp[]]"])
    assert "GPU available" not in result.stdout.str() + result.stderr.str()  # the check's Trainer says nothing
    assert not {"checkpoints", "lightning_logs"} & {p.name for p in pytester.path.iterdir()}


@pytest.mark.parametrize("kwargs, message", [
    ("epochs_text", "max_epochs='ten' is not what Trainer(max_epochs=...) takes*"),  # was an INTERNALERROR
    ("strategy_int", "strategy=42 is not what Trainer(strategy=...) takes*"),  # passed every item
    ("strategy_unknown", "strategy='horovod' is not a strategy Lightning knows*"),  # failed after the whole run
])
def test_bad_trainer_kwargs_are_a_usage_error_before_any_world(pytester, kwargs, message):
    pytester.makepyfile(targets_mod=TARGETS, trainers=TRAINERS)
    result = pytester.runpytest_subprocess("--ltconform", f"targets_mod.Good trainer=trainers:{kwargs}",
                                           "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([WHERE.format(kwargs) + message])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    assert "ltconform-world" not in result.stdout.str()  # nothing ran


def test_file_path_target_and_collect_only_start_no_world(pytester):
    path = pytester.makepyfile(targets_mod=TARGETS)
    result = pytester.runpytest_subprocess("--ltconform", f"{path}:Good", "--collect-only", "-q")
    result.stdout.fnmatch_lines([f"ltconform::{path}:Good::all-rank-save[[]ddp[]]",
                                 f"ltconform::{path}:Good::sync-dist[[]ddp[]]"])
    assert result.ret == pytest.ExitCode.OK


def test_command_line_target_runs_contracts_alone_unless_paths_are_given(pytester):
    path = pytester.makepyfile(targets_mod=TARGETS)
    pytester.makepyfile(test_user="def test_user_code():\n    pass\n")
    alone = pytester.runpytest_subprocess("--ltconform", f"{path}:Good", "--collect-only", "-q")
    assert "test_user.py::test_user_code" not in alone.stdout.str()
    alone.stdout.fnmatch_lines([f"ltconform::{path}:Good::all-rank-save[[]ddp[]]"])
    both = pytester.runpytest_subprocess("--ltconform", f"{path}:Good", "--collect-only", "-q", "test_user.py")
    both.stdout.fnmatch_lines(["test_user.py::test_user_code", f"ltconform::{path}:Good::all-rank-save[[]ddp[]]"])


NOTHING_HEAVY = """
import sys

def test_user_code():
    assert not {"torch", "lightning", "pytorch_lightning"} & set(sys.modules)
"""


def test_selecting_your_own_tests_with_ini_targets_costs_nothing_extra(pytester):
    """Targets in the ini file (or from the conftest hook) join a run that names no test path, or
    whose -m names an ltconform marker; a run of your own tests imports nothing heavy, validates
    no target and adds no contract item."""
    pytester.makepyfile(targets_mod=TARGETS)
    pytester.makeini("[pytest]\nltconform_target = targets_mod.Good\nltconform_strategies = ddp\n")
    pytester.makepyfile(test_user=NOTHING_HEAVY)
    for args in (["-m", "not ltconform"], ["test_user.py::test_user_code"], ["test_user.py"],
                 ["test_user.py", "-m", "not slow"]):
        result = pytester.runpytest_subprocess(*args, "-p", "no:cacheprovider")
        assert result.parseoutcomes() == {"passed": 1}, args  # nothing deselected: no contract item exists
        result.stdout.fnmatch_lines(["collected 1 item"])
        out = result.stdout.str()
        unchecked = "ltconform: the ltconform_target targets are not checked in this run: it names test paths"
        # A run naming paths says its ini targets went unchecked (a CI job must not read as checked);
        # a run that deselects them with -m does not. No other ltconform line: nothing was validated.
        assert (unchecked in out) == (args[0] != "-m"), args
        assert "ltconform:" not in out.replace(unchecked, ""), args
    # The whole run, and a path run that asks for the contracts by marker, still get them.
    for args in ([], ["test_user.py", "-m", "ltconform"]):
        ids = _ids(pytester.runpytest_subprocess(*args, "--collect-only", "-q", "-p", "no:cacheprovider"))
        assert "ltconform::targets_mod.Good::sync-dist[ddp]" in ids, args
        assert ("test_user.py::test_user_code" in ids) == (not args), args


def _ids(result) -> list[str]:
    return [line for line in result.stdout.lines if "::" in line]


def test_importing_target_for_conftest_imports_no_torch_or_lightning():
    import subprocess
    import sys

    code = ("import sys\nfrom pytest_ltconform import Target\n"
            "Target('pkg.M', init={'hidden': 4}, trainer={'max_epochs': 1})\n"
            "print(sorted(m for m in ('torch', 'lightning', 'pytorch_lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr


PARTIAL_HOOKS = """
import functools

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).sum()

    def test_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class DataModule(L.LightningDataModule):
    # As some libraries do: the hooks are partials set on the instance, which Lightning accepts.
    def __init__(self):
        super().__init__()
        self.train_dataloader = functools.partial(self._loader, 8)
        self.test_dataloader = functools.partial(self._loader, 4)

    def _loader(self, n):
        return DataLoader(TensorDataset(torch.randn(n, 2)), batch_size=2)
"""


def test_data_hooks_set_on_the_instance_count_as_lightning_counts_them(tmp_path, monkeypatch):
    """A datamodule whose train_dataloader is a partial assigned in __init__ (a Trainer fits it) was
    refused at start ("no train_dataloader is defined"), and its test stage was never run."""
    from pytest_ltconform import harness
    from pytest_ltconform.target import validation as target_validation

    (tmp_path / "partial_hooks.py").write_text(PARTIAL_HOOKS)
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.delitem(__import__("sys").modules, "partial_hooks", raising=False)
    validated = target_validation.validate("partial_hooks.Model", datamodule="partial_hooks.DataModule")
    assert validated.model_name == "Model"
    assert harness.later_stages(harness.UserObjects(validated)) == ["test"]


def test_an_evaluation_loader_set_on_the_instance_is_evaluated(tmp_path, monkeypatch):
    """eval-duplication said "the target has no validation, test or predict dataloader" (and passed) for a
    test_dataloader assigned in the datamodule's __init__ (pytorch-lifestream's PtlsDataModule does so)."""
    from pytest_ltconform import harness
    from pytest_ltconform.contracts.eval_duplication import probe
    from pytest_ltconform.target import validation as target_validation

    (tmp_path / "partial_hooks.py").write_text(PARTIAL_HOOKS)
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.delitem(__import__("sys").modules, "partial_hooks", raising=False)
    objects = harness.UserObjects(target_validation.validate("partial_hooks.Model",
                                                             datamodule="partial_hooks.DataModule"))
    assert probe._has_loader(objects, "test") and not probe._has_loader(objects, "validate")
