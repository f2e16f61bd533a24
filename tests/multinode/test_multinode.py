"""The multinode tier against the real launchers: pytest runs as one rank of a two-node world.

- two torchrun agents on localhost (``--nnodes 2 --node-rank 0/1``, gloo);
- a real two-node SLURM cluster on this host (``srun -N 2 --ntasks-per-node=1``), including a
  task layout that disagrees with the Trainer, which the launch-env contract must catch;
- ranks that collect different items stop with a clear error instead of hanging.

Marked ``multinode`` (deselected by default): ``python -m pytest -m multinode tests/multinode``.
The SLURM tests need ``.ci/install-slurm`` (they skip, naming what is missing, without it).
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from cluster import SlurmCluster, free_ports, launcher_free_env, run_concurrently, slurm_available, torchrun_two_agents

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.multinode

BORING = "lightning.pytorch.demos.boring_classes.BoringModel"
PYTEST = ["-m", "pytest", "-p", "no:cacheprovider", "-v", "-W", "ignore::DeprecationWarning"]
TIMEOUT = 420

needs_slurm = pytest.mark.skipif(slurm_available() is not None, reason=f"SLURM: {slurm_available()}")


def _explain(results) -> str:
    return "\n".join(f"=== agent/task output {i}: rc={r.returncode} {r.duration:.1f}s timed_out={r.timed_out}\n"
                     f"{r.stdout[-6000:]}\n--- stderr\n{r.stderr[-4000:]}" for i, r in enumerate(results))


def _check_multinode_pass(rank0_out: str, expected_world: str) -> None:
    assert f"pytest is rank 0 of a {expected_world} world of 2 ranks" in rank0_out
    assert "launch-env[ddp-multinode] PASSED" in rank0_out
    assert "all-rank-save[ddp-multinode] PASSED" in rank0_out
    assert " failed" not in rank0_out.splitlines()[-1] and " passed" in rank0_out.splitlines()[-1]


USER_TEST = """
import os

def where(ctx, tag):
    return (tag, ctx.rank, ctx.world_size, os.environ["GROUP_RANK"])

def test_world_fixture_runs_on_every_rank_of_the_launched_world(ltconform_world):
    world = ltconform_world()
    assert world.world_size == 2
    assert world.run(where, "x") == [("x", 0, 2, "0"), ("x", 1, 2, "1")]
"""


def test_torchrun_two_agents_run_the_multinode_tier(tmp_path):
    results = torchrun_two_agents([*PYTEST, "--ltconform", BORING, "-m", "ltconform_multinode"],
                                  timeout=TIMEOUT, cwd=tmp_path)
    explain = _explain(results)
    assert [r.returncode for r in results] == [0, 0], explain
    rank0, rank1 = results
    _check_multinode_pass(rank0.stdout, "torchrun")
    # Rank 1 ran every item too, but quietly: no report of its own.
    assert "PASSED" not in rank1.stdout and "ltconform summary" not in rank1.stdout, explain


def test_torchrun_world_fixture_runs_inside_the_launched_world(tmp_path):
    (tmp_path / "test_user.py").write_text(USER_TEST)
    results = torchrun_two_agents([*PYTEST, "--ltconform", BORING, "-m", "not ltconform", "test_user.py"],
                                  timeout=TIMEOUT, cwd=tmp_path)
    explain = _explain(results)
    assert [r.returncode for r in results] == [0, 0], explain
    rank0, rank1 = results
    assert "test_world_fixture_runs_on_every_rank_of_the_launched_world PASSED" in rank0.stdout, explain
    assert "PASSED" not in rank1.stdout, explain


def test_torchrun_one_sided_save_is_diagnosed_and_the_world_serves_later_items(tmp_path):
    case = REPO / "conformance" / "all-rank-save" / "callback_save_rank_zero_only.py"
    args = ["-p", "no:warnings", "--ltconform", f"{case}:Model", "--ltconform-trainer", f"{case}:trainer_kwargs",
            "--ltconform-strategies", "ddp", "--ltconform-timeout", "20", "-m", "ltconform_multinode"]
    results = torchrun_two_agents([*PYTEST, *args], timeout=TIMEOUT, cwd=tmp_path)
    explain = _explain(results)
    assert not any(r.timed_out for r in results) and all(r.returncode != 0 for r in results), explain
    out = " ".join(results[0].stdout.split())
    assert "all-rank-save[ddp-multinode] FAILED" in out, explain
    assert "Trainer.save_checkpoint called on rank 0 only" in out and "callback_save_rank_zero_only.py:28" in out
    # The job after the broken one gets a fresh process group in the same world.
    assert "launch-env[ddp-multinode] PASSED" in out, explain


def test_torchrun_ranks_that_collect_differently_stop_with_a_clear_error(tmp_path):
    # A conftest that drops one test on node 1 only: the collections differ.
    (tmp_path / "conftest.py").write_text(textwrap.dedent("""
        import os
        def pytest_collection_modifyitems(items):
            if os.environ.get("GROUP_RANK") == "1":
                items[:] = [i for i in items if "second" not in i.name]
    """))
    (tmp_path / "test_plain.py").write_text("def test_first():\n    pass\n\ndef test_second():\n    pass\n")
    results = torchrun_two_agents([*PYTEST, "--ltconform", BORING, "-m", "not ltconform", "test_plain.py"],
                                  timeout=180, cwd=tmp_path)
    explain = _explain(results)
    assert not any(r.timed_out for r in results), explain
    for r in results:
        assert r.returncode != 0, explain
        assert "collected different tests" in r.stdout + r.stderr, explain
        assert "test_plain.py::test_second" in r.stdout + r.stderr, explain
    assert max(r.duration for r in results) < 120, explain


@needs_slurm
def test_slurm_two_nodes_run_the_multinode_tier_and_launch_env_catches_a_bad_layout(tmp_path):
    (tmp_path / "layout.py").write_text(
        "def trainer_kwargs():\n    return {'num_nodes': 2, 'devices': 2, 'strategy': 'ddp'}\n")
    srun = ["-N", "2", "--ntasks-per-node=1", sys.executable, *PYTEST, "--ltconform", BORING]
    with SlurmCluster() as cluster:
        good = cluster.srun([*srun, "-m", "ltconform_multinode"], timeout=TIMEOUT, cwd=tmp_path)
        explain = f"{_explain([good])}\n{cluster.log_tails()}"
        assert good.returncode == 0, explain
        _check_multinode_pass(good.stdout, "slurm")

        # The Trainer says 2 nodes x 2 devices; SLURM started 1 task per node.
        bad = cluster.srun([*srun, "--ltconform-trainer", f"{tmp_path / 'layout.py'}:trainer_kwargs",
                            "-m", "ltconform_multinode", "-k", "launch-env"], timeout=TIMEOUT, cwd=tmp_path)
    explain = _explain([bad])
    assert bad.returncode != 0 and not bad.timed_out, explain
    assert "launch-env[ddp-multinode] FAILED" in bad.stdout, explain
    out = " ".join(bad.stdout.split())
    assert "SLURM_NTASKS=2 but num_nodes 2 x devices 2 = 4" in out, explain
    assert "SLURM_NTASKS_PER_NODE=1 but the Trainer has devices=2" in out, explain
    assert "docs/contracts/launch-env.md" in out and "'Multi-node launch'" in out, explain


# -- the nodes cases: the same verdicts in a real two-node launch as on the nodes tier ------------------

NODE_CASES = (
    "node-local-files/prepare_data_once_into_node_local_tmp",
    "node-local-files/ok_prepare_data_per_node_into_node_local_tmp",
    "node-local-files/checkpoint_dir_under_node_local_tmp", "node-local-files/ok_checkpoint_dir_under_shared_root",
    "data-sharding/iterable_shards_by_local_rank", "data-sharding/ok_iterable_shards_by_global_rank",
    "shared-writes/local_rank_guard_writes_shared_history", "shared-writes/ok_global_zero_guard_writes_shared_history",
)
WORDS = {"fail": ("failed",), "pass": ("passed",), "nofail": ("passed", "skipped")}


@pytest.mark.parametrize("name", NODE_CASES)
def test_a_nodes_case_gets_its_verdict_under_two_torchrun_agents(tmp_path, name):
    """Each agent is a node with its own TMPDIR (what a cluster node's scratch is); both share the
    run's folder. The [ddp-multinode] items of the contracts the case names get the verdicts its
    EXPECTED gives, which the corpus holds the [ddp-2nodes] items to (tests/test_corpus.py)."""
    from pytest_ltconform import contracts, corpus

    path = REPO / "conformance" / f"{name}.py"
    case = corpus.read_case(str(path))
    named = [c for c in case.expected if c in contracts.ids()]
    args = ["--ltconform", f"{path}:Model", "-m", "ltconform_multinode", "--ltconform-timeout", "60",
            "-k", " or ".join(f"{c}[" for c in named), "--ltconform-report", str(tmp_path / "r.json")]
    if case.has_datamodule:
        args += ["--ltconform-datamodule", f"{path}:DataModule"]
    if case.has_trainer:
        args += ["--ltconform-trainer", f"{path}:trainer_kwargs"]
    shared = tmp_path / "shared"
    shared.mkdir()
    agents = []
    port = free_ports(1)[0]
    for node in (0, 1):
        scratch = tmp_path / f"node{node}-tmp"
        scratch.mkdir()
        agents.append(["env", f"TMPDIR={scratch}", sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                       "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr", "127.0.0.1",
                       "--master-port", str(port), *PYTEST, *args])
    results = run_concurrently(agents, TIMEOUT, env=launcher_free_env({"LTCONFORM_SHARED_DIR": str(shared)}),
                               cwd=tmp_path)
    explain = _explain(results)
    assert not any(r.timed_out for r in results), explain
    records = json.loads((tmp_path / "r.json").read_text())["results"]
    got = {r["contract"]: (r["outcome"], r.get("category")) for r in records
           if r["strategy"] == "ddp-multinode" and not r.get("run")}
    for cid in named:
        outcome, category = got.get(cid, (None, None))
        # As the corpus counts it: a contract not judged because another item's failure stopped the run
        # is no miss of a "pass".
        assert outcome in WORDS[case.expected[cid]] or (case.expected[cid] != "fail" and category == "consequence"), \
            f"{cid}: {outcome} ({category})\n{explain}"
    failing = any(case.expected[c] == "fail" for c in named)
    assert all((r.returncode != 0) == failing for r in results), explain
