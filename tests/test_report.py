"""The JSON report is never lost and says what the session was: a session that judged nothing
leaves an earlier report alone, the report says whether the session was interrupted and its exit
status, a terminal line says where it was written, two reports of one config compare equal, and
tiers that cannot run here are a count each, not a record per item (test_first_run.py).

The pytest subprocesses here select no contract item (``-m "not ltconform"``), so none starts a
world; they still validate the ini target (torch and Lightning are imported).
"""

from __future__ import annotations

import json
import os
import stat

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


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device whose writes fail: ENOSPC)")
def test_a_report_that_cannot_be_written_fails_the_session_naming_the_path_and_the_os_error(pytester):
    # /dev/full takes the open and fails the write, as a full disk does; it is written in place, never
    # replaced by a file (the report's rename would put a file where the device was).
    pytester.makeini(INI.replace("reports/lt.json", "/dev/full"))
    pytester.makepyfile(test_unit=UNIT_TEST)
    result = pytester.runpytest_subprocess("-m", "not ltconform", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()[-2000:]
    result.stdout.fnmatch_lines(["pytest-ltconform: could not write the JSON report to /dev/full: No space left on "
                                 "device (errno 28, ENOSPC); the session fails*"])
    assert "generated ltconform report file" not in result.stdout.str()
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


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

    from pytest_ltconform import report
    from pytest_ltconform.target import validation as target_validation

    paths = []
    for n in range(2):  # two reports of one config, with callbacks built anew each time
        kwargs = {"max_epochs": 1, "callbacks": [ModelCheckpoint(monitor="x"), EarlyStopping(monitor="x")]}
        validated = target_validation.validate(BORING, trainer=kwargs, id="m")
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
                                           "--ltconform-nodes", "1", "-k", "all-rank-save", "-p", "no:cacheprovider")
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out[-3000:]
    assert "USER-OUTPUT of rank 1" in out  # the rank's own output is shown
    # The recorder's float() of the logged tensor is not the user's doing.
    assert "Converting a tensor with requires_grad=True" not in out, out[-5000:]


RAISES = '''
from lightning.pytorch.demos.boring_classes import BoringModel


class Model(BoringModel):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise ZeroDivisionError("the user's own bug")
        return super().training_step(batch, batch_idx)
'''


def test_a_users_exception_is_reported_once_on_the_item_named_for_the_run(pytester, no_leftover_ranks):
    pytester.makepyfile(raises=RAISES)
    result = pytester.runpytest_subprocess("--ltconform", "raises.Model", "--ltconform-strategies", "ddp",
                                           "--ltconform-nodes", "1",
                                           "-k", "all-rank-save or sync-dist", "-p", "no:cacheprovider", "-v", "-rs")
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out[-3000:]
    result.assert_outcomes(failed=1, skipped=2, deselected=result.parseoutcomes()["deselected"])
    result.stdout.fnmatch_lines(["*collected * items / * deselected / 3 selected*",
                                 "ltconform::raises.Model::fit[[]ddp[]] FAILED*",
                                 "ltconform::raises.Model::all-rank-save[[]ddp[]] SKIPPED*",
                                 "ltconform::raises.Model::sync-dist[[]ddp[]] SKIPPED*"])
    # The run's item leads with the rank's exception at the user's line; the contracts point at it.
    # Every rank raised it on its own, at the same line: none is named a consequence of another.
    result.stdout.fnmatch_lines(["*[[]fit[[]ddp[]][]] the run did not finish: ranks 0 and 1 each raised "
                                 "ZeroDivisionError at *raises.py:7 (training_step)*"])
    assert "Consequences, not causes" not in out
    assert out.count("raise ZeroDivisionError(\"the user's own bug\")") == 1, out
    for contract in ("all-rank-save", "sync-dist"):
        result.stdout.fnmatch_lines([f"SKIPPED*ltconform::raises.Model::{contract}[[]ddp[]]*not judged*"
                                     f"(see fit[[]ddp[]])*"])


def test_a_run_item_passes_when_its_run_finished_and_follows_k(pytester, no_leftover_ranks):
    result = pytester.runpytest_subprocess("--ltconform", BORING, "--ltconform-strategies", "ddp",
                                           "--ltconform-nodes", "1", "-k",
                                           "all-rank-save or sync-dist or strategy-config", "-p", "no:cacheprovider",
                                           "-v", "-rA")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines([f"ltconform::{BORING}::fit[[]ddp[]] PASSED*"])
    # -rA says what the run item is, as it says what each contract item checked.
    result.stdout.fnmatch_lines(["*= PASSES =*", f"_* ltconform {BORING}::fit[[]ddp[]] _*",
                                 "the run finished on 2 ranks: fit (*. This item records the run; the contract "
                                 "items judge it."])
    result.assert_outcomes(passed=4, deselected=result.parseoutcomes()["deselected"])
    # One contract item of a run: no run item (-k sync-dist selects one item, and it is judged as before).
    one = pytester.runpytest_subprocess("--ltconform", BORING, "--ltconform-strategies", "ddp",
                                        "--ltconform-nodes", "1", "-k", "sync-dist",
                                        "--collect-only", "-q", "-p", "no:cacheprovider")
    assert [ln for ln in one.stdout.lines if ln.startswith("ltconform::")] == [f"ltconform::{BORING}::sync-dist[ddp]"]


def test_the_seeds_are_said_in_the_header_and_the_report():
    """Issue 38 §1: the header says how the ranks were seeded, with the seeds, so a run can be repeated."""
    from pytest_ltconform.header import seeding_words
    from pytest_ltconform.report import seeding_entry

    assert seeding_words("both", 0, 2).startswith("both (random, numpy and torch seeded with 0 + rank (rank 0: 0, "
                                                  "rank 1: 1) until the fit's training starts, then with 0 on every "
                                                  "rank")
    assert "as after seed_everything(0)" in seeding_words("same", 0, 2)
    assert "rank 0: 0, rank 1: 1, rank 2: 2" in seeding_words("per-rank", 0, 3)
    assert seeding_entry("both", 0, 2) == {"mode": "both", "seed": 0, "ranks": [0, 1]}
    assert seeding_entry("same", 0, 2)["ranks"] == [0, 0]


def test_a_record_names_its_rule_section_as_such_and_holds_no_seed_of_it(tmp_path):
    """NOTES (i36): a record wrote the rule section under "seed" too, a leftover of the seed ->
    rule_section rename; a JSON reader took a rule section for a random seed. The report's seeds are
    its ``seeding``; a record has ``rule_section`` only."""
    from pytest_ltconform.contracts import get_contract
    from pytest_ltconform.outcomes import Outcome
    from pytest_ltconform.report import record, write_json

    verdict = get_contract("sync-dist").verdict(Outcome.PASSED, "every logged value is synced.")
    rec = record("sync-dist", "ddp", 2, verdict.as_dict(), 1.0, target="t")
    path = tmp_path / "lt.json"
    write_json(str(path), "t", 2, [rec], seeding={"mode": "both", "seed": 0, "ranks": [0, 1]})
    doc = json.loads(path.read_text())
    (result,) = doc["results"]
    assert result["rule_section"] == "Sampling, metrics and writes"
    assert "seed" not in result and "seed" not in verdict.as_dict()
    assert doc["seeding"]["seed"] == 0
