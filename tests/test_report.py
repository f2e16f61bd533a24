"""The JSON report is never lost and says what the session was: a session that judged nothing
leaves an earlier report alone, the report says whether the session was interrupted and its exit
status, a terminal line says where it was written, two reports of one config compare equal, and
tiers that cannot run here are a count each, not a record per item (test_first_run.py).

The pytest subprocesses here select no contract item (``-m "not ltconform"``), so none starts a
world; they still validate the ini target (torch and Lightning are imported).
"""

from __future__ import annotations

import json

import pytest
from conftest import BORING

pytest_plugins = ["pytester"]

INI = f"[pytest]\nltconform_target = {BORING}\nltconform_strategies = ddp\nltconform_report = reports/lt.json\n"

UNIT_TEST = "def test_unit():\n    assert 1 + 1 == 2\n"


def test_a_session_that_judged_nothing_leaves_an_earlier_report_alone(pytester):
    pytester.makeini(INI)
    pytester.makepyfile(test_unit=UNIT_TEST)
    report = pytester.path / "reports" / "lt.json"
    report.parent.mkdir()
    earlier = '{"results": ["the last conformance verdicts"]}\n'
    report.write_text(earlier)
    result = pytester.runpytest_subprocess("-m", "not ltconform", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-2000:]
    assert report.read_text() == earlier
    assert f"\nltconform: nothing was judged, so the JSON report {report} was left as an earlier session wrote " \
           f"it\n" in result.stdout.str()
    assert "generated ltconform report file" not in result.stdout.str()


def test_the_report_says_where_it_went_its_exit_status_and_counts_tiers_not_run(pytester):
    pytester.makeini(INI)
    pytester.makepyfile(test_unit=UNIT_TEST)
    report = pytester.path / "reports" / "lt.json"
    result = pytester.runpytest_subprocess("-m", "not ltconform", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-2000:]
    result.stdout.fnmatch_lines([f"*- generated ltconform report file: {report} -*"])
    doc = json.loads(report.read_text())
    assert (doc["interrupted"], doc["exitstatus"], doc["results"]) == (False, 0, [])


def test_an_interrupted_session_says_so_in_the_report(pytester):
    pytester.makeini(INI)
    pytester.makepyfile(test_unit="def test_stopped():\n    raise KeyboardInterrupt\n")
    report = pytester.path / "reports" / "lt.json"
    result = pytester.runpytest_subprocess("-m", "not ltconform", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.INTERRUPTED, result.stdout.str()[-2000:]
    doc = json.loads(report.read_text())
    assert (doc["interrupted"], doc["exitstatus"]) == (True, int(pytest.ExitCode.INTERRUPTED))


def test_callback_reprs_carry_no_memory_address(tmp_path):
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    from pytest_ltconform import report, target

    paths = []
    for n in range(2):  # two reports of one config, with callbacks built anew each time
        kwargs = {"max_epochs": 1, "callbacks": [ModelCheckpoint(monitor="x"), EarlyStopping(monitor="x")]}
        validated = target.validate(BORING, trainer=kwargs, id="m")
        paths.append(tmp_path / f"r{n}.json")
        report.write_json(str(paths[-1]), BORING, 2, [], targets=[validated])
    docs = [json.loads(p.read_text()) for p in paths]
    docs[0]["versions"] = docs[1]["versions"]
    assert docs[0] == docs[1]
    callbacks = docs[0]["targets"][0]["trainer"]["callbacks"]
    assert callbacks == ["<lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint object>",
                         "<lightning.pytorch.callbacks.early_stopping.EarlyStopping object>"]


# -- what the terminal shows ---------------------------------------------------------------------

DIES = '''
import os

from lightning.pytorch.demos.boring_classes import BoringModel


class Model(BoringModel):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("train_loss", out["loss"])  # a tensor that requires grad
        if self.global_rank == 1 and batch_idx == 2:
            print("USER-OUTPUT of rank 1", flush=True)
            os._exit(3)
        return out
'''


def test_a_ranks_output_shows_no_warning_the_plugin_caused(pytester, no_leftover_ranks):
    pytester.makepyfile(dies=DIES)
    result = pytester.runpytest_subprocess("--ltconform", "dies.Model", "--ltconform-strategies", "ddp",
                                           "-k", "all-rank-save", "-p", "no:cacheprovider")
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out[-3000:]
    assert "USER-OUTPUT of rank 1" in out  # the rank's own output is shown
    # The recorder's float() of the logged tensor is not the user's doing.
    assert "Converting a tensor with requires_grad=True" not in out, out[-5000:]
