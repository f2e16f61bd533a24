"""shared-writes: the rank-side write probe on real files, and verdicts on hand-made write events
(the worlds themselves are exercised by the corpus, tests/test_corpus.py)."""

from __future__ import annotations

import os

import pytest
from conftest import case

from pytest_ltconform.contracts import get_contract


class _Recorder:
    def __init__(self):
        self.events = []
        self._fh = open(os.devnull, "w")
        self._patches = []

    def emit(self, event):
        self.events.append(event)

    def current_hook(self):
        return "Model.on_train_end"

    def patch(self, owner, name, factory):
        original = getattr(owner, name)
        setattr(owner, name, factory(original))
        self._patches.append((owner, name, original))

    def undo(self):
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)


def test_shared_writes_probe_records_open_and_torch_save(tmp_path, monkeypatch):
    import torch

    from pytest_ltconform.contracts.shared_writes import probe as shared_writes

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


def test_the_writability_check_of_tempfile_is_not_a_user_write(tmp_path, monkeypatch):
    """Field trial tnodes F5-F7: a pass listed random names (f1iccqxy) as files user code writes; they are the
    file the first tempfile.gettempdir() of a process writes and removes to test its folder."""
    import tempfile

    from pytest_ltconform.contracts.shared_writes import probe as shared_writes

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # the next gettempdir() checks the folder afresh
    recorder = _Recorder()
    probe = shared_writes.SharedWritesProbe()
    try:
        probe.before_trainer(None, {"default_root_dir": str(tmp_path)}, recorder)
        folder = tempfile.gettempdir()
        with open(os.path.join(folder, "index.npy"), "w") as fh:
            fh.write("1")
    finally:
        probe.collect(None, None, recorder)
        recorder.undo()
    assert folder == str(tmp_path)
    assert [os.path.basename(e["path"]) for e in recorder.events] == ["index.npy"]


def test_shared_writes_verdicts(fake_runs):
    contract = get_contract("shared-writes")
    site = {"file": "/u/m.py", "line": 3, "func": "Model.on_validation_epoch_end"}
    write = {"ev": "write", "path": "<default_root_dir>/val.csv", "mode": "a", "site": site,
             "hook": "Model.on_validation_epoch_end", "epoch": 0}
    verdict = contract.judge(fake_runs.run([[write], [write]]))
    assert verdict.outcome == "failed" and "val.csv opened for appending by rank 0 and rank 1" in verdict.summary
    assert contract.judge(fake_runs.run([[write], []])).outcome == "passed"


def test_a_write_in_a_later_stage_names_the_stage(fake_runs):
    contract = get_contract("shared-writes")
    site = {"file": "/u/m.py", "line": 9, "func": "Writer.write_on_epoch_end"}
    write = {"ev": "write", "path": "<default_root_dir>/predictions/predictions.pt", "mode": "torch.save",
             "site": site, "hook": "[Callback]Writer.on_predict_epoch_end"}
    trace = [{"ev": "stage", "name": "fit"}, {"ev": "stage", "name": "predict"}, write]
    verdict = contract.judge(fake_runs.run([trace, trace]))
    assert verdict.outcome == "failed"
    assert ("predictions.pt written with torch.save by rank 0 and rank 1 in [Callback]Writer.on_predict_epoch_end "
            "during predict at /u/m.py:9") in verdict.summary
    quiet = [{"ev": "stage", "name": "fit"}, {"ev": "stage", "name": "test"}]
    assert "during fit and test" in contract.judge(fake_runs.run([quiet, quiet])).summary
    raised = quiet + [{"ev": "stage_error", "name": "test", "exc_type": "FileNotFoundError", "message": "gone.pt"}]
    verdict = contract.judge(fake_runs.run([raised, quiet]))
    assert verdict.outcome == "passed"
    assert "during fit and test (until it raised) (outside checkpoint saving)" in verdict.summary
    assert verdict.notes == ["the test stage, which the plugin runs after fit on the same Trainer, raised "
                             "FileNotFoundError on rank 0 (gone.pt), so writes after that point were not recorded."]


@pytest.mark.slow
def test_prediction_writer_saving_one_path_on_every_rank_fails_in_a_real_world(pytester, no_leftover_ranks):
    path = case("shared-writes/prediction_writer_same_file_every_rank.py").rsplit(":", 1)[0]
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ltconform", f"{path}:Model",
                                           "--ltconform-datamodule", f"{path}:DataModule",
                                           "--ltconform-trainer", f"{path}:trainer_kwargs",
                                           "--ltconform-nodes", "1", "-k", "shared-writes[ and ddp", "-v")
    out = result.stdout.str()
    result.assert_outcomes(failed=1)
    assert "predictions.pt written with torch.save by rank 0 and rank 1" in out and "during predict" in out
    assert "prediction_writer_same_file_every_rank.py:33" in out  # the user's torch.save line


_THIRD_PARTY_LOGGER = '''
import json
import os

from lightning.pytorch.callbacks import Callback


class StatsLogger(Callback):  # like GraphGym's LoggerCallback: Lightning calls it, no user frame above
    def on_train_epoch_end(self, trainer, pl_module):
        out = os.path.join(trainer.default_root_dir, "train")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "stats.json"), "a") as fh:
            fh.write(json.dumps({"epoch": trainer.current_epoch}) + "\\n")
'''

_MODEL_USING_IT = '''
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch_statslib import StatsLogger


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def configure_callbacks(self):
        return [StatsLogger()]

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)),
                          batch_size=4)
'''


@pytest.mark.slow
def test_an_installed_package_named_torch_something_writing_on_every_rank_fails(pytester, no_leftover_ranks,
                                                                                  monkeypatch):
    # A third-party package whose name starts with "torch" (torch_geometric) is the user's code, not torch's.
    pkg = pytester.path / "site-packages" / "torch_statslib"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(_THIRD_PARTY_LOGGER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(pkg.parent), os.environ.get("PYTHONPATH")])))
    pytester.makepyfile(stats_model=_MODEL_USING_IT)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ltconform", "stats_model.py:Model",
                                           "--ltconform-nodes", "1", "-k", "shared-writes[ and ddp", "-v")
    out = result.stdout.str()
    result.assert_outcomes(failed=1)
    assert "stats.json opened for appending by rank 0 and rank 1" in out
    assert "site-packages/torch_statslib/__init__.py:12 (StatsLogger.on_train_epoch_end)" in out  # its open()


@pytest.mark.slow
def test_node_leaders_renaming_one_shared_file_fail_shared_writes_which_claims_the_stop(pytester, no_leftover_ranks):
    """huggingface/pytorch-image-models#693: `if self.local_rank == 0:` around a write and os.replace in the shared
    run folder; on 2 nodes both leaders rename it and one raises FileNotFoundError. shared-writes owns that stop
    (it said "not judged: the shared fit run did not finish" before), and the fit item names it."""
    path = case("shared-writes/local_rank_guard_replaces_shared_summary.py").rsplit(":", 1)[0]
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ltconform", f"{path}:Model",
                                           "--ltconform-datamodule", f"{path}:DataModule",
                                           "--ltconform-nodes", "2", "-k", "2nodes", "-rA")
    out = result.stdout.str()
    assert result.parseoutcomes().get("failed") == 1
    assert "FAILED ltconform::" in out and "shared-writes[ddp-2nodes]" in out
    assert "summary.csv.tmp written and renamed with os.replace by global rank 0 (node 0) and global rank 1 " \
           "(node 1)" in out
    assert "raised FileNotFoundError" in out and "renamed it without error" in out
    assert "the write sits under `if self.local_rank == 0:`" in out  # the guard line, read from the source
    assert "local_rank_guard_replaces_shared_summary.py:62" in out  # each rank's os.replace call
    assert "replace `if self.local_rank == 0:` with `if self.trainer.is_global_zero:`" in out
    assert "the run stopped because of the shared-writes[ddp-2nodes] failure" in out
def test_appends_from_every_rank_say_no_row_count_the_run_did_not_record(fake_runs):
    """Seen on lightning-uq-box (pandas to_csv, mode='a', from every rank): each rank wrote its own
    rows, yet the message said the file "ends with 4 rows where 2 are meant". Only the opens are
    recorded: the harm said is the one path every rank appends to."""
    from pytest_ltconform import claims

    site = {"file": "/u/m.py", "line": 3, "func": "Model.on_validation_epoch_end",
            "library": {"file": "/v/lib/python3.12/site-packages/pandas/core/generic.py", "line": 3967,
                        "func": "NDFrame.to_csv"}}
    write = {"ev": "write", "path": "<default_root_dir>/preds.csv", "mode": "a", "site": site,
             "hook": "Model.on_validation_epoch_end", "epoch": 0}
    verdict = get_contract("shared-writes").judge(fake_runs.run([[write, write], [write, write]]))
    assert verdict.outcome == "failed" and "rows where" not in verdict.summary
    assert "2 ranks append to this one file (4 appends)" in verdict.summary
    # The user's line first, the package function it called after it.
    assert "at /u/m.py:3 (Model.on_validation_epoch_end), in pandas/core/generic.py:3967 (NDFrame.to_csv)" \
        in verdict.summary
    assert claims.check({"contract": verdict.contract, **verdict.as_dict()}) == []
    old = "[shared-writes] FAILED: preds.csv ...: it ends with 4 rows where 2 are meant, and appends can interleave."
    assert any("unrecorded" in p for p in claims.check({"contract": "shared-writes", "message": old}))


def test_a_write_inside_an_installed_library_is_placed_at_the_users_own_line(tmp_path):
    """The user's package is pip-installed too (a PyPI LightningModule): the write's site is its
    innermost frame (the package the module comes from), then the library function it called."""
    import importlib
    import sys

    from pytest_ltconform.contracts.shared_writes.probe import _user_frame_and_checkpointing

    packages = tmp_path / "site-packages"
    (packages / "libx").mkdir(parents=True)
    (packages / "mypkg").mkdir()
    (packages / "libx" / "__init__.py").write_text("import sys\n\ndef write(probe):\n"
                                                   "    return probe(sys._getframe())\n")
    (packages / "mypkg" / "__init__.py").write_text("from libx import write\n\n\ndef save(probe):\n"
                                                     "    return write(probe)\n")
    sys.path.insert(0, str(packages))
    try:
        mypkg = importlib.import_module("mypkg")
        own = (os.path.realpath(packages / "mypkg") + os.sep,)
        site, saving = mypkg.save(lambda frame: _user_frame_and_checkpointing(frame, own))
    finally:
        sys.path.remove(str(packages))
        for name in ("mypkg", "libx"):
            sys.modules.pop(name, None)
    assert not saving
    assert site["file"].endswith(os.path.join("mypkg", "__init__.py")) and site["line"] == 5
    assert site["library"]["file"].endswith(os.path.join("libx", "__init__.py")) and site["library"]["line"] == 4
