"""The plugin's own runs keep what the module sees in a user's run: the Trainer config the harness
builds (loggers for callbacks that need one, intervals within the bounded epoch), one working
folder per run shared by its ranks, the sharded resume check and the one-rank references."""

from __future__ import annotations

import os

import pytest

from pytest_ltconform import harness, trainer_overrides

pytest_plugins = ["pytester"]


def test_callbacks_that_need_a_logger_get_one_in_the_run_folder(tmp_path):
    from lightning.pytorch.callbacks import DeviceStatsMonitor, LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    lr, stats = LearningRateMonitor(), DeviceStatsMonitor()
    built = harness.build_trainer_kwargs({"callbacks": [lr, stats]}, "ddp", 2, str(tmp_path), accelerator="cpu",
                                         num_nodes=1)
    logger = built["logger"]
    assert isinstance(logger, CSVLogger) and built["callbacks"] == [lr, stats]
    logger.log_hyperparams({"lr": 0.1})  # Trainer.fit logs the module's hparams: CSVLogger wrote hparams.yaml
    logger.log_metrics({"lr-SGD": 0.1}, step=0)
    logger.finalize("success")  # keeps the values, writes no file the contracts would judge as the user's
    assert logger.experiment.metrics == [{"lr-SGD": 0.1, "step": 0}]
    assert not [f for _, _, files in os.walk(tmp_path) for f in files]
    assert trainer_overrides.overridden({"callbacks": [lr, stats]}, 2) == [
        "callbacks: LearningRateMonitor, DeviceStatsMonitor need a logger: each run gives it a CSVLogger that writes "
        "no file"]
    assert trainer_overrides.overridden({"logger": True, "callbacks": [lr]}, 2) == [
        "logger=True -> a CSVLogger (callbacks LearningRateMonitor needs a logger: each run gives it a CSVLogger "
        "that writes no file)"]
    # Without such a callback the runs keep no logger, as before.
    assert harness.build_trainer_kwargs({"logger": True}, "ddp", 2, str(tmp_path), accelerator="cpu",
                                        num_nodes=1)["logger"] is False


def test_logger_comes_from_the_callbacks_namespace(tmp_path):
    from pytorch_lightning.callbacks import LearningRateMonitor
    from pytorch_lightning.loggers import CSVLogger

    built = harness.build_trainer_kwargs({"callbacks": [LearningRateMonitor()]}, "ddp", 2, str(tmp_path),
                                         accelerator="cpu", num_nodes=1)
    assert isinstance(built["logger"], CSVLogger)


def test_val_check_interval_stays_within_the_bounded_epoch(tmp_path):
    built = harness.build_trainer_kwargs({"val_check_interval": 500}, "ddp", 2, str(tmp_path), accelerator="cpu",
                                         num_nodes=1)
    assert built["val_check_interval"] == trainer_overrides.LIMIT_BATCHES
    assert trainer_overrides.overridden({"val_check_interval": 500}, 2) == [
        "val_check_interval=500 -> 4 (within the bounded epoch of 4 training batches)"]
    for kept in (0.5, 2, 1.0):
        assert harness.build_trainer_kwargs({"val_check_interval": kept}, "ddp", 2, str(tmp_path),
                                            accelerator="cpu", num_nodes=1)["val_check_interval"] == kept
        assert trainer_overrides.overridden({"val_check_interval": kept}, 2) == []



STEP = {"ev": "hook", "i": 1, "h": 1, "name": "[LightningModule]Model.training_step", "epoch": 0, "step": 0}


def test_value_comparing_items_are_not_judged_on_a_nonfinite_loss(fake_runs):
    import types

    from pytest_ltconform.session import LtconformSession
    from pytest_ltconform.settings import Settings

    site = {"file": "/src/model.py", "line": 36, "func": "Model.training_step"}
    nan = {"ev": "nonfinite", "loss": "nan", "step": 2, "epoch": 0, "batch_idx": 2, "site": site}
    session = LtconformSession(Settings(target="model.Model"), None, pool=types.SimpleNamespace(fresh_per_job=False))
    # Rank 0 saw a non-finite loss one step later than rank 1: rank 1's is the one named.
    session._runs[session._key("fit", "ddp", "cpu")] = fake_runs.run(
        traces=[[STEP, dict(nan, step=3, loss="inf")], [STEP, nan]], values=[{}, {}])
    verdict, _ = session.verdict("sync-dist", "ddp")
    assert verdict.outcome == "not_judged", verdict.render()
    assert verdict.not_judged.reason.startswith("the training loss was nan on rank 1 at step 2 (epoch 0, batch 2), "
                                      "returned at /src/model.py:36 (Model.training_step)")
    # A contract that compares no values judges as usual on the same run.
    assert session.verdict("shared-writes", "ddp")[0].outcome == "passed"


# -- runs as a user makes them (every CPU strategy), in a pytest subprocess -------------------------

def run_case(pytester, relpath: str, *extra: str) -> dict:
    """``{"contract[strategy]": (outcome, message)}`` of a default plugin run over a corpus case."""
    import json

    from conftest import case

    path = case(relpath).rsplit(":", 1)[0]
    source = open(path).read()
    args = ["-p", "no:cacheprovider", "--ltconform", f"{path}:Model", "--ltconform-report", "out.json", *extra]
    if "def trainer_kwargs" in source:
        args += ["--ltconform-trainer", f"{path}:trainer_kwargs"]
    if "class DataModule" in source:
        args += ["--ltconform-datamodule", f"{path}:DataModule"]
    result = pytester.runpytest_subprocess(*args)
    assert "INTERNALERROR" not in result.stdout.str(), result.stdout.str()[-3000:]
    doc = json.loads((pytester.path / "out.json").read_text())
    return {f"{r['contract']}[{r['strategy']}]": (r["outcome"], r["message"]) for r in doc["results"]
            if r.get("category") != "unavailable"}


def outcomes(items: dict, contract: str) -> set:
    return {outcome for item, (outcome, _) in items.items() if item.startswith(contract + "[")}


@pytest.mark.slow
def test_ranks_share_the_run_folder_per_rank_files_merged_by_rank_zero(pytester, no_leftover_ranks):
    # Rank 0 reads every rank's predictions_<rank>.pt after a barrier: with a folder per rank it
    # found no predictions_1.pt, and eval-duplication was left not judged.
    items = run_case(pytester, "shared-writes/ok_prediction_writer_per_rank_files.py")
    assert items["eval-duplication[ddp]"][0] == "passed", items["eval-duplication[ddp]"]
    assert {o for o, _ in items.values()} == {"passed"}, {k: v for k, v in items.items() if v[0] != "passed"}


@pytest.mark.slow
def test_relative_per_rank_files_in_fit_merged_after_a_barrier(pytester, no_leftover_ranks):
    items = run_case(pytester, "shared-writes/ok_per_rank_stats_merged_after_barrier.py")
    assert {o for o, _ in items.values()} == {"passed"}, {k: v for k, v in items.items() if v[0] != "passed"}
    assert "stats.json by rank 0 only" in items["shared-writes[ddp]"][1]


@pytest.mark.slow
def test_shared_folder_still_shows_two_ranks_writing_one_relative_path(pytester, no_leftover_ranks):
    pytester.makepyfile(same_relative_file="""
        import lightning.pytorch as L
        from lightning.pytorch.demos.boring_classes import BoringModel

        class Model(BoringModel):
            def on_train_epoch_end(self):
                with open("summary.txt", "w") as fh:  # every rank, one path in the shared working folder
                    fh.write(str(self.current_epoch))
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ltconform", "same_relative_file.Model",
                                           "--ltconform-strategies", "ddp", "--ltconform-nodes", "1",
                                           "-k", "shared-writes", "-v")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*summary.txt opened for writing by rank 0 and rank 1 in *on_train_epoch_end*"])


@pytest.mark.slow
def test_production_config_with_lr_monitor_plateau_and_long_val_interval_runs(pytester, no_leftover_ranks):
    # LearningRateMonitor refused the logger-less Trainer; val_check_interval=50 exceeded the capped
    # epoch; the sharded resume ran without validation, so ReduceLROnPlateau missed val_loss.
    items = run_case(pytester, "sync-dist/ok_lr_monitor_plateau_on_val_loss.py")
    assert {o for o, _ in items.values()} == {"passed"}, {k: v for k, v in items.items() if v[0] != "passed"}
    assert "resumed from it with the matching strategy" in items["all-rank-save[fsdp]"][1]
    assert "The resumed fit then stopped" not in items["all-rank-save[fsdp]"][1]


@pytest.mark.slow
def test_extra_runs_get_a_fresh_datamodule_and_a_loader_with_its_dataset(pytester, no_leftover_ranks):
    items = run_case(pytester, "effective-batch/ok_datamodule_released_on_teardown.py",
                     "--ltconform-strategies", "ddp", "-k", "effective-batch[")
    assert items["effective-batch[ddp]"][0] == "passed", items["effective-batch[ddp]"]
    assert "world-size invariant" in items["effective-batch[ddp]"][1]


@pytest.mark.slow
def test_partial_optimizer_under_unconfigured_fsdp_is_named_not_failed(pytester, no_leftover_ranks):
    for relpath in ("unused-parameters/no_grad_teacher_not_frozen.py",
                    "unused-parameters/ok_head_only_optimizer_backbone_trained_by_nobody.py"):
        items = run_case(pytester, relpath, "--ltconform-strategies", "ddp,fsdp", "-k", "all-rank-save")
        outcome, message = items["all-rank-save[fsdp]"]
        # The plugin chose the sharded save (the config saves one file): not judged, never failed.
        assert outcome == "skipped", message
        assert "the plugin's FSDP run saved" in message and "not in the optimizer state" in message


@pytest.mark.slow
def test_nonfinite_loss_is_named_and_nothing_is_judged_on_top_of_it(pytester, no_leftover_ranks):
    items = run_case(pytester, "sync-dist/nonfinite_loss_on_rank_one.py")
    assert "failed" not in {o for o, _ in items.values()}, {k: v for k, v in items.items() if v[0] == "failed"}
    for item in ("sync-dist[ddp]", "sync-dist[fsdp]", "eval-duplication[ddp]", "configure-model[ddp]"):
        outcome, message = items[item]
        assert outcome == "skipped", (item, message)
        assert "the training loss was nan on rank 1 at step 2" in message, message
        assert "nonfinite_loss_on_rank_one.py:36 (Model.training_step)" in message, message
    assert items["all-rank-save[ddp]"][0] == "passed"
    assert "not finite" in items["all-rank-save[fsdp]"][1]


@pytest.mark.slow
def test_rank_zero_file_of_synced_metrics_is_not_a_rank_zero_evaluation(pytester, no_leftover_ranks):
    # history.csv holds trainer.callback_metrics of a sync_dist=True val_loss: whole-set values.
    items = run_case(pytester, "all-rank-save/ok_callback_metrics_read_before_guard.py")
    assert {o for o, _ in items.values()} == {"passed"}, {k: v for k, v in items.items() if v[0] != "passed"}
    variant = run_case(pytester, "eval-duplication/ok_rank_zero_json_of_synced_test_metrics.py",
                       "--ltconform-strategies", "ddp", "-k", "eval-duplication[ or shared-writes[")
    assert {o for o, _ in variant.values()} == {"passed"}, variant
