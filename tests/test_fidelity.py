"""The plugin's own runs keep what the module sees in a user's run: the Trainer config the harness
builds (loggers for callbacks that need one, intervals within the bounded epoch), one working
folder per run shared by its ranks, the sharded resume check and the one-rank references."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]


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
                                           "--ltconform-strategies", "ddp", "-k", "shared-writes", "-v")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*summary.txt opened for writing by rank 0 and rank 1 in *on_train_epoch_end*"])
