"""Contracts judged through the plugin: pytest items over a corpus case, in a pytest subprocess."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_plugin_fails_shared_writes_and_spawn_safety_items(pytester, no_leftover_ranks):
    from conftest import case

    path = case("spawn-safety/lambda_loss_and_open_log_file.py").rsplit(":", 1)[0]
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--ltconform", f"{path}:Model", "--ltconform-datamodule", f"{path}:DataModule",
        "--ltconform-trainer", f"{path}:trainer_kwargs",
        # "contract[ddp]": the target's id (its path, under conformance/spawn-safety/) matches -k too.
        "-k", "spawn-safety[ddp] or shared-writes[ddp] or data-sharding[ddp]", "-v")
    out = result.stdout.str()
    result.assert_outcomes(failed=1, passed=3)  # and the fit[ddp] run item that shared-writes and data-sharding share
    assert "Model.loss_fn does not pickle: it is a lambda" in out and "DataModule.log" in out
    # The failure's block is printed once, in FAILURES; the summary names the item in one line.
    assert out.count("\nFix: ") == 1, out
    assert "failed (each block is in FAILURES above)" in out


def test_an_advisory_item_does_not_fail_the_run(pytester, no_leftover_ranks):
    from conftest import case

    path = case("unused-parameters/find_unused_true_nothing_unused.py").rsplit(":", 1)[0]
    args = ["-p", "no:cacheprovider", "--ltconform", f"{path}:Model", "-k", "unused-parameters[ddp]",
            "-v"]
    if "def trainer_kwargs" in open(path).read():
        args += ["--ltconform-trainer", f"{path}:trainer_kwargs"]
    if "class DataModule" in open(path).read():
        args += ["--ltconform-datamodule", f"{path}:DataModule"]
    result = pytester.runpytest_subprocess(*args)
    assert result.ret == 0, result.stdout.str()[-3000:]
    assert result.parseoutcomes().get("advisory") == 1
    result.stdout.fnmatch_lines(["*unused-parameters*ddp*ADVISORY*", "*find_unused_parameters=True*"])
