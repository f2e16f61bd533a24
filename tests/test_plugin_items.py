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
        "-k", "(spawn-safety or shared-writes or data-sharding) and not gpu and not multinode and not fsdp", "-v")
    out = result.stdout.str()
    result.assert_outcomes(failed=1, passed=2)
    assert "Model.loss_fn does not pickle: it is a lambda" in out and "DataModule.log" in out
