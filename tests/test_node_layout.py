"""Local worlds of several nodes on this host: each rank gets what a launcher sets
on a real node and its node's own temp storage, fresh for every job.

The worlds start inside a pytest subprocess (a hung world never takes this session down) and
preload torch only: machinery, not a fit.
"""

from __future__ import annotations

pytest_plugins = ["pytester"]

NODE_WORLD = '''
import os
import tempfile

import pytest
import torch.distributed as dist

from pytest_ltconform.world import JobRequest, LocalWorld
from pytest_ltconform.world.layout import Layout

KEYS = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE", "WORLD_SIZE")


def facts(ctx):
    """What this rank sees, and whether a file its peer wrote under the same node-local spelling is here."""
    tmp = tempfile.gettempdir()
    mine = os.path.join(tmp, "written-here")
    with open(mine, "w") as fh:
        fh.write(str(ctx.rank))
    with open(f"/dev/shm/ltconform-test-{os.getpid()}", "w") as fh:
        fh.write(str(ctx.rank))
    dist.barrier()
    with open(mine) as fh:
        found = fh.read()
    shm = sorted(n for n in os.listdir("/dev/shm") if n.startswith("ltconform-test-"))
    dist.barrier()
    os.remove(f"/dev/shm/ltconform-test-{os.getpid()}")
    return {"env": {k: os.environ[k] for k in KEYS}, "tmp": tmp, "tmpdir": os.environ["TMPDIR"],
            "slurm_tmpdir": os.environ["SLURM_TMPDIR"], "node_rank": ctx.node_rank, "node_local": ctx.node_local,
            "storage": ctx.node_storage, "found": found, "shm": len(shm), "num_nodes": ctx.num_nodes}


def leftover(ctx):
    return sorted(os.listdir(tempfile.gettempdir()))


def _world(how, monkeypatch, layout=Layout(2, 1)):
    monkeypatch.setenv("LTCONFORM_NODE_ISOLATION", how)
    return LocalWorld(layout=layout, preload=("torch.distributed",))


@pytest.mark.parametrize("how", ["mountns", "tmpdir"])
def test_every_rank_sits_on_its_node_with_its_nodes_own_storage(how, monkeypatch):
    world = _world(how, monkeypatch)
    try:
        first = world.run(JobRequest("test_nodes_inner:facts", timeout_s=120)).values
        second = world.run(JobRequest("test_nodes_inner:leftover", timeout_s=120)).values
    finally:
        world.close()
    for rank, f in enumerate(first):
        assert f["env"] == {"RANK": str(rank), "LOCAL_RANK": "0", "NODE_RANK": str(rank), "GROUP_RANK": str(rank),
                            "GROUP_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2"}, f
        assert f["node_rank"] == rank and f["num_nodes"] == 2, f
        # TMPDIR, SLURM_TMPDIR and tempfile agree: the job's fresh folder in the node's storage.
        assert f["tmp"] == f["tmpdir"] == f["slurm_tmpdir"] == f["node_local"], f
        assert f["storage"] == how, f  # namespaces work on this host; tmpdir is what was asked
        # Each rank finds its own file under its node-local spelling, never its peer's.
        assert f["found"] == str(rank), f
    if how == "mountns":
        # One spelling on every node (as /tmp on a cluster), two files; /dev/shm is each node's own too.
        assert first[0]["tmp"] == first[1]["tmp"]
        assert [f["shm"] for f in first] == [1, 1]
    else:
        assert first[0]["tmp"] != first[1]["tmp"]
    # The next job gets a fresh folder: nothing the first job left there is found again.
    assert second == [[], []]


def test_two_ranks_of_one_node_share_its_storage(monkeypatch):
    world = _world("mountns", monkeypatch, Layout(2, 2))
    try:
        got = world.run(JobRequest("test_nodes_inner:facts", timeout_s=120)).values
    finally:
        world.close()
    assert [f["env"]["LOCAL_RANK"] for f in got] == ["0", "1", "0", "1"]
    assert [f["node_rank"] for f in got] == [0, 0, 1, 1]
    assert all(f["storage"] == "mountns" for f in got), got
    # The second rank of a node wrote the same file its node's first rank wrote (one node, one /tmp).
    found = [f["found"] for f in got]
    assert found[0] == found[1] in ("0", "1") and found[2] == found[3] in ("2", "3"), got
    assert [f["shm"] for f in got] == [2, 2, 2, 2]
'''


def test_local_worlds_of_several_nodes(pytester):
    pytester.makepyfile(test_nodes_inner=NODE_WORLD)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-q")
    result.assert_outcomes(passed=3)
