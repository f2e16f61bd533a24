"""Tiers: markers on the generated items, skip reasons that name what is missing,
--ltconform-require, attached-world detection, and the launch-env judgement. Items of a tier
that cannot run here exist only when asked for (-m) or required (tests/test_first_run.py has
the hiding decision itself).

Fast: nothing here starts a world (tier items skip before any run; the rest are unit tests).
The real two-node runs are in tests/multinode (marker ``multinode``).
"""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from pytest_ltconform import tiers, vocabulary
from pytest_ltconform.contracts import launch_env
from pytest_ltconform.world.attached import _collection_difference

pytest_plugins = ["pytester"]

BORING = "lightning.pytorch.demos.boring_classes.BoringModel"



@pytest.fixture(autouse=True)
def _boring_stays_imported():
    """In-process pytester runs unload modules they imported; torch refuses to import some of
    Lightning's twice, so the target's module is imported once, outside the runs."""
    import lightning.pytorch.demos.boring_classes  # noqa: F401


no_gpus_here = pytest.mark.skipif(tiers.cuda_device_count() >= 2, reason="this machine has CUDA devices")


def _ids(result) -> list[str]:
    return [line for line in result.stdout.lines if line.startswith("ltconform::")]


# The items of a BoringModel on the nodes tier (a local world of two nodes).
NODE_ITEMS = ("fit", "all-rank-save", "sync-dist", "data-sharding", "shared-writes", "launch-env", "node-local-files")


def test_markers_select_tiers_under_strict_markers(pytester):
    base = ["--strict-markers", "--ltconform", BORING, "--collect-only", "-q"]
    every = _ids(pytester.runpytest(*base))
    cpu = _ids(pytester.runpytest(*base, "-m", "ltconform_cpu"))
    nodes = _ids(pytester.runpytest(*base, "-m", "ltconform_nodes"))
    gpu = _ids(pytester.runpytest(*base, "-m", "ltconform_gpu"))
    multi = _ids(pytester.runpytest(*base, "-m", "ltconform_multinode"))
    ds = _ids(pytester.runpytest(*base, "-m", "ltconform_deepspeed"))
    not_gpu = _ids(pytester.runpytest(*base, "-m", "ltconform and not ltconform_gpu"))
    item = f"ltconform::{BORING}::"
    assert f"{item}all-rank-save[ddp]" in cpu and f"{item}all-rank-save[ddp-gpu]" in gpu
    assert f"{item}all-rank-save[ddp-multinode]" in multi and f"{item}launch-env[ddp-multinode]" in multi
    assert all(i.endswith(("[ddp]", "[fsdp]", "[deepspeed]")) for i in cpu)
    assert all(i.endswith(("-gpu]",)) for i in gpu)
    assert all(i.endswith("-multinode]") for i in multi)
    # The node-sensitive contracts on a local world of two nodes: ddp only (fsdp where the config names FSDP).
    assert sorted(i.removeprefix(item) for i in nodes) == sorted(f"{c}[ddp-2nodes]" for c in NODE_ITEMS)
    # The deepspeed marker selects real DeepSpeed on both tiers: CPU gloo ranks and the GPU runner
    # (here, without GPUs, the [deepspeed-gpu] items exist only when -m names the gpu tier too).
    assert ds and all(i.endswith(("[deepspeed]", "[deepspeed-gpu]")) for i in ds)
    assert f"{item}all-rank-save[deepspeed]" in cpu and f"{item}all-rank-save[deepspeed-gpu]" in gpu
    assert not [i for i in multi if "deepspeed" in i]
    if tiers.cuda_device_count() < 2:  # gpu and multinode items exist here only when -m asks for them
        assert sorted(every) == sorted(cpu + nodes) and sorted(not_gpu) == sorted(cpu + nodes)
        assert not [i for i in ds if i.endswith("-gpu]")]
    else:
        assert sorted(every) == sorted(cpu + nodes + gpu) and sorted(not_gpu) == sorted(cpu + nodes)
    # launch-env judges a launch: it has no items on one local node.
    assert not [i for i in cpu + gpu if "launch-env" in i]
    # Only the strategies asked for; and no world of several nodes with --ltconform-nodes 1.
    ddp_only = _ids(pytester.runpytest(*base, "--ltconform-strategies", "ddp"))
    assert ddp_only and all("fsdp" not in i and "deepspeed" not in i for i in ddp_only)
    one_node = _ids(pytester.runpytest(*base, "--ltconform-nodes", "1"))
    assert sorted(one_node) == sorted(cpu)
    three = _ids(pytester.runpytest(*base, "--ltconform-nodes", "3x1", "--ltconform-oversubscribe", "-m",
                                    "ltconform_nodes"))
    assert f"{item}launch-env[ddp-3nodes]" in three and len(three) == len(nodes)


@no_gpus_here
def test_gpu_tier_skips_naming_missing_devices_and_require_turns_it_into_a_failure(pytester):
    result = pytester.runpytest("--strict-markers", "--ltconform", BORING, "-m", "ltconform_gpu", "-rs")
    outcomes = result.parseoutcomes()
    assert outcomes.get("skipped", 0) > 0 and set(outcomes) <= {"skipped", "deselected"}, outcomes
    result.stdout.fnmatch_lines(["SKIPPED * needs 2 CUDA devices, found 0"])
    assert result.ret == pytest.ExitCode.OK

    result = pytester.runpytest("--ltconform", BORING, "-m", "ltconform_gpu", "--ltconform-world-size", "3",
                                "--ltconform-oversubscribe", "-rs")  # 3 ranks may exceed this machine's CPUs
    result.stdout.fnmatch_lines(["SKIPPED * needs 3 CUDA devices, found 0"])

    report = pytester.path / "required.json"
    required = pytester.runpytest("--ltconform", BORING, "-m", "ltconform_gpu and not ltconform_deepspeed",
                                  "--ltconform-require", "gpu", "--ltconform-report", str(report))
    assert required.ret == pytest.ExitCode.TESTS_FAILED
    failed = required.parseoutcomes().get("failed", 0)
    assert failed == outcomes["skipped"] - _deepspeed_items(pytester)
    required.stdout.fnmatch_lines(["*--ltconform-require gpu: the gpu tier cannot run here: needs 2 CUDA "
                                   "devices, found 0*"])
    # The summary has the failed column, and the one reason once for the whole tier.
    out = required.stdout.str()
    # Up to pytest's short summary, which repeats each failure's whole message on CI.
    summary = out.split("ltconform summary")[1].split("short test summary info")[0]
    assert re.search(r"^contract\s+ddp-gpu", summary, re.M), summary
    assert re.search(r"^sync-dist\s+failed", summary, re.M), summary
    assert summary.count("the gpu tier cannot run here") == 1, summary
    assert f"and {failed - 1} more item(s) of that tier" in summary, summary
    # The JSON report lists every one as failed.
    records = json.loads(report.read_text())["results"]
    assert len(records) == failed and {r["outcome"] for r in records} == {"failed"}, records


def _deepspeed_items(pytester) -> int:
    return len(_ids(pytester.runpytest("--ltconform", BORING, "-m", "ltconform_deepspeed and ltconform_gpu",
                                       "--collect-only", "-q")))


@pytest.mark.skipif(tiers.cuda_device_count() > 0 or importlib.util.find_spec("deepspeed") is None,
                    reason="needs deepspeed installed on a machine without CUDA devices")
@pytest.mark.parametrize("user_imports_deepspeed", [False, True])
def test_checking_deepspeed_prints_nothing_before_the_header(pytester, user_imports_deepspeed):
    # -s: nothing captures what the import of deepspeed prints in this process: either the
    # availability check's import, or the user's module importing deepspeed first.
    # What the session's own environment holds once the targets are validated and checked.
    pytester.makeconftest("import os\n\ndef pytest_collection_finish(session):\n"
                          "    print('DS_ACCELERATOR after collection:', os.environ.get('DS_ACCELERATOR'))\n")
    model = BORING
    if user_imports_deepspeed:
        pytester.makepyfile(dsmodel="import deepspeed\n"
                                    "from lightning.pytorch.demos.boring_classes import BoringModel\n")
        model = "dsmodel.py:BoringModel"
    result = pytester.runpytest_subprocess("--ltconform", model, "--ltconform-strategies", "deepspeed",
                                           "--collect-only", "-q", "-s", "-p", "no:cacheprovider")
    out = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.OK and "sync-dist[deepspeed]" in out, out[-2000:]
    assert "Setting accelerator to CPU" not in out, out[:2000]
    assert "DS_ACCELERATOR after collection: None" in out, out[-2000:]  # the user's environment is untouched


def test_deepspeed_tier_skips_when_deepspeed_is_missing(pytester):
    # Where deepspeed is installed, this conftest makes it look missing (find_spec answers None).
    pytester.makeconftest('import sys\nsys.modules["deepspeed"] = None\n')
    result = pytester.runpytest("--ltconform", BORING, "-m", "ltconform_deepspeed", "-rs")
    result.stdout.fnmatch_lines(["SKIPPED * deepspeed not importable*pip install 'deepspeed>=0.16'*"])
    # Requiring the gpu tier does not make a missing optional package fail the GPU runner.
    assert "failed" not in result.parseoutcomes()
    required = pytester.runpytest("--ltconform", BORING, "-m", "ltconform_deepspeed", "--ltconform-require",
                                  "deepspeed")
    assert required.ret == pytest.ExitCode.TESTS_FAILED


@pytest.mark.world
def test_a_deepspeed_whose_import_raises_skips_its_tier_and_the_others_still_run(pytester, monkeypatch):
    # A DeepSpeed build broken on this machine raises at import (not ImportError). The ranks'
    # parent imports it too: it must leave it out, as a spawned rank would, not stop answering.
    pytester.mkpydir("deepspeed").joinpath("__init__.py").write_text(
        'raise RuntimeError("broken build: libaio not found")\n')
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    result = pytester.runpytest_subprocess("--ltconform", BORING, "--ltconform-strategies", "ddp,deepspeed",
                                           "--ltconform-nodes", "1", "-k", "sync-dist", "-rs", "-p", "no:cacheprovider")
    out = result.stdout.str()
    outcomes = result.parseoutcomes()
    assert (outcomes.get("passed"), outcomes.get("skipped"), outcomes.get("errors")) == (1, 1, None), out[-3000:]
    result.stdout.fnmatch_lines(["SKIPPED * deepspeed not importable (RuntimeError: broken build: libaio not found)*"])


def test_multinode_tier_skips_outside_a_launched_world_and_require_fails(pytester, monkeypatch):
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    result = pytester.runpytest("--ltconform", BORING, "-m", "ltconform_multinode", "-rs")
    result.stdout.fnmatch_lines(["SKIPPED * not inside a multi-node world: no torchrun or SLURM launch found*"])
    assert result.ret == pytest.ExitCode.OK
    required = pytester.runpytest("--ltconform", BORING, "-m", "ltconform_multinode", "-k", "launch",
                                  "--ltconform-require", "multinode")
    required.assert_outcomes(failed=1, deselected=required.parseoutcomes()["deselected"])


# -- units ---------------------------------------------------------------------------------------

class _Contract:
    def __init__(self, strategies, tiers_=None):
        self.strategies = strategies
        if tiers_:
            self.tiers = tiers_


def test_cpu_deepspeed_variant_needs_the_package_not_a_gpu():
    found = tiers.variants(_Contract(("ddp", "fsdp", "deepspeed")), ("deepspeed",), vocabulary.CPU_STRATEGIES)
    cpu = [v for v in found if v.tier == "cpu"]
    assert [(v.label, v.needs, v.markers) for v in cpu] == \
        [("deepspeed", ("cpu", "deepspeed"), ("ltconform_cpu", "ltconform_deepspeed"))]
    missing = tiers.Availability(2, deepspeed_missing=lambda: "deepspeed not importable (x; pip install y)")
    assert missing.first_missing(cpu[0]) == ("deepspeed", "deepspeed not importable (x; pip install y)")
    assert [v.label for v in found if v.tier != "cpu"] == ["deepspeed-gpu"]


def test_variants_per_contract():
    labels = [v.label for v in tiers.variants(_Contract(("ddp", "fsdp")), ("ddp", "fsdp", "deepspeed"),
                                              ("ddp", "fsdp"))]
    assert labels == ["ddp", "fsdp", "ddp-gpu", "fsdp-gpu", "deepspeed-gpu", "ddp-multinode", "fsdp-multinode"]
    assert [v.label for v in tiers.variants(_Contract(("ddp",)), vocabulary.GPU_STRATEGIES, ("ddp",))] == \
        ["ddp", "ddp-gpu", "ddp-multinode"]
    assert [v.label for v in tiers.variants(_Contract(("ddp",), ("multinode",)), ("ddp",), ("ddp",))] == \
        ["ddp-multinode"]
    ds = tiers.variants(_Contract(("fsdp",)), ("fsdp", "deepspeed"), ("fsdp",))[-2]
    assert ds.label == "deepspeed-gpu" and ds.needs == ("deepspeed", "gpu")
    assert set(ds.markers) == {"ltconform_gpu", "ltconform_deepspeed"}


def _attached(rank=0, launcher="torchrun"):
    return tiers.Attached(launcher=launcher, environment="TorchElasticEnvironment", rank=rank, world_size=4,
                          local_rank=0, node_rank=rank // 2, main_address="127.0.0.1", main_port=29500,
                          agent_store=True)


def test_availability_reasons():
    local = tiers.Availability(2, cuda_count=lambda: 1, deepspeed_missing=lambda: None)
    assert local.missing("cpu") is None
    assert local.missing("gpu") == "needs 2 CUDA devices, found 1"
    assert local.missing("deepspeed") is None
    assert local.missing("multinode").startswith("not inside a multi-node world")
    assert tiers.Availability(2, cuda_count=lambda: 8).missing("gpu") is None
    # Inside a launched world nothing local runs, whatever the hardware, so every rank decides alike.
    inside = tiers.Availability(2, _attached(), num_nodes=2, cuda_count=lambda: 8)
    assert inside.missing("multinode") is None
    assert "rank 0 of a torchrun world of 4 ranks" in inside.missing("gpu")
    assert "-m ltconform_multinode" in inside.missing("cpu")
    one_node = tiers.Availability(2, _attached(), num_nodes=1)
    assert "needs 2 or more nodes" in one_node.missing("multinode")
    v = tiers.Variant("deepspeed", "deepspeed", "deepspeed-gpu", (), ("deepspeed", "gpu"))
    no_ds = tiers.Availability(2, cuda_count=lambda: 0, deepspeed_missing=lambda: "deepspeed not importable")
    assert no_ds.first_missing(v) == ("deepspeed", "deepspeed not importable")


def test_detect_attached_uses_lightning_environments(monkeypatch):
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_JOB_NAME", "MASTER_PORT", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    assert tiers.detect_attached() is None
    env = {"TORCHELASTIC_RUN_ID": "none", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "GROUP_RANK": "1",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    a = tiers.detect_attached()
    assert (a.launcher, a.rank, a.world_size, a.node_rank, a.main_port, a.agent_store) == \
        ("torchrun", 3, 4, 1, 29400, True)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert tiers.detect_attached() is None  # a world of one rank is no world to attach to
    for key in env:
        monkeypatch.delenv(key)
    slurm = {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
             "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "3071", "MASTER_ADDR": "127.0.0.1"}
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    a = tiers.detect_attached()
    assert (a.launcher, a.environment, a.rank, a.node_rank, a.main_port, a.agent_store) == \
        ("slurm", "SLURMEnvironment", 1, 1, 18071, False)
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "1")
    assert tiers.detect_attached().world_size == 2
    monkeypatch.delenv("MASTER_PORT", raising=False)  # SLURMEnvironment.main_port exports it
    monkeypatch.setenv("SLURM_JOB_NAME", "bash")  # Lightning: an interactive shell, not a launch
    assert tiers.detect_attached() is None


def test_collection_difference_names_the_first_difference():
    a = {"items": ["x", "y", "z"], "errors": 0}
    assert _collection_difference(a, dict(a), 1) is None
    assert "item 2 is 'y' on rank 0 but 'q' on rank 1" in _collection_difference(a, {"items": ["x", "q", "z"]}, 1)
    assert "only rank 0 has is 'z'" in _collection_difference(a, {"items": ["x", "y"]}, 1)
    assert "collection error" in _collection_difference(a, {"items": ["x", "y", "z"], "errors": 1}, 1)


def _torchrun_env(rank, nodes=2, per_node=1, **extra):
    env = {"TORCHELASTIC_RUN_ID": "none", "RANK": str(rank), "WORLD_SIZE": str(nodes * per_node),
           "LOCAL_RANK": str(rank % per_node), "GROUP_RANK": str(rank // per_node), "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29400"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _judge(envs, **trainer):
    views = [launch_env.view(e, i) for i, e in enumerate(envs)]
    return launch_env.check(views, {"num_nodes": None, "devices": None, "timeout_s": None, **trainer})


def test_launch_env_accepts_a_consistent_torchrun_launch():
    problems, notes, layout = _judge([_torchrun_env(r, 2, 2) for r in range(4)], num_nodes=2, devices=2)
    assert problems == [] and notes == []
    assert (layout["nodes"], layout["per_node"], layout["world"]) == (2, 2, 4)
    problems, notes, _ = _judge([_torchrun_env(r) for r in range(2)])
    assert problems == [] and "do not set num_nodes and devices" in notes[0]


def test_launch_env_finds_each_kind_of_disagreement():
    envs = [_torchrun_env(0), _torchrun_env(1, MASTER_PORT=29401)]
    problems, _, _ = _judge(envs, num_nodes=2, devices=1)
    assert any("MASTER_PORT differs across ranks (rank 0: 29400, rank 1: 29401)" in p[2] for p in problems)

    problems, _, _ = _judge([_torchrun_env(r) for r in range(2)], num_nodes=1, devices=1)
    assert [p[2] for p in problems] == ["WORLD_SIZE=2 but num_nodes 1 x devices 1 = 1",
                                        "the launch spans 2 nodes (GROUP_RANK 0, 1) but the Trainer has num_nodes=1"]

    envs = [_torchrun_env(0, NODE_RANK=0), _torchrun_env(1, NODE_RANK=0)]
    problems, _, _ = _judge(envs, num_nodes=2, devices=1)
    assert [(p[1], p[2]) for p in problems] == [(1, "NODE_RANK=0 but the launcher's GROUP_RANK=1")]

    envs = [_torchrun_env(r, NCCL_TIMEOUT=1800) for r in range(2)]
    problems, _, _ = _judge(envs, num_nodes=2, devices=1)
    assert "NCCL_TIMEOUT=1800 is set on rank(s) 0, 1" in problems[0][2]
    problems, notes, _ = _judge(envs, num_nodes=2, devices=1, timeout_s=600.0)
    assert problems == [] and "NCCL_TIMEOUT=1800 is set but has no effect" in notes[0]


def test_launch_env_judges_slurm_task_layouts():
    common = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train", "SLURM_NNODES": "2", "SLURM_NTASKS": "2",
              "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODELIST": "n[1-2]", "SLURM_LOCALID": "0"}
    envs = [{**common, "SLURM_NODEID": str(n), "SLURM_PROCID": str(n)} for n in range(2)]
    problems, _, layout = _judge(envs, num_nodes=2)
    details = [p[2] for p in problems]
    assert "SLURM_NTASKS_PER_NODE=2 but 1 process per node (devices=1)" in details
    assert "SLURM_NTASKS=2 != SLURM_NNODES 2 x SLURM_NTASKS_PER_NODE 2 = 4" in details
    assert layout["master"] == "n1:19242"  # Lightning's defaults: first node, 15000 + job id digits
    good = [{**e, "SLURM_NTASKS_PER_NODE": "1"} for e in envs]
    assert _judge(good, num_nodes=2, devices=1)[0] == []
    problems, _, _ = _judge(good, num_nodes=2, devices=2)
    assert "SLURM_NTASKS_PER_NODE=1 but the Trainer has devices=2" in [p[2] for p in problems]
    bash = [{**e, "SLURM_JOB_NAME": "bash"} for e in good]
    assert "interactive shell" in _judge(bash, num_nodes=2, devices=1)[0][0][2]


def test_build_trainer_kwargs_takes_the_world_parameters(monkeypatch):
    from pytest_ltconform.harness import build_trainer_kwargs
    from pytest_ltconform.world import rank

    cpu = build_trainer_kwargs({"devices": 8, "accelerator": "gpu"}, "ddp", 2, "/tmp/x")
    assert (cpu["accelerator"], cpu["devices"], cpu["num_nodes"]) == ("cpu", 2, 1)
    gpu = build_trainer_kwargs({}, "ddp", 4, "/tmp/x", accelerator="gpu", num_nodes=2)
    assert (gpu["accelerator"], gpu["devices"], gpu["num_nodes"]) == ("gpu", 2, 2)
    # What the job runner's context says for an NCCL world spanning two nodes.
    ctx = rank.RankContext(0, 2, 0, "/tmp/x", "/tmp/x.trace", None, accelerator="gpu", num_nodes=2)
    monkeypatch.setattr(rank, "_CURRENT", ctx)
    job = build_trainer_kwargs({}, "ddp", 2, "/tmp/x")
    assert (job["accelerator"], job["devices"], job["num_nodes"]) == ("gpu", 1, 2)


def test_gpu_tier_uses_the_real_sharded_strategy_and_the_users_own():
    import lightning.pytorch as L
    from lightning.pytorch.strategies import FSDPStrategy

    from pytest_ltconform.harness import adapt_strategy

    built = adapt_strategy(L, "fsdp", None, 12.0, accelerator="gpu")
    assert type(built) is FSDPStrategy and built._timeout.total_seconds() == 12.0
    mine = FSDPStrategy(sharding_strategy="SHARD_GRAD_OP")
    assert adapt_strategy(L, "fsdp", mine, 12.0, accelerator="gpu") is mine
    assert adapt_strategy(L, "deepspeed", "deepspeed_stage_3", 12.0, accelerator="gpu") == "deepspeed_stage_3"
    # The CPU tier keeps its own FSDP subclass (Lightning refuses the real class on CPU).
    assert type(adapt_strategy(L, "fsdp", None, 12.0, accelerator="cpu")) is not FSDPStrategy


class _RecordingWorld:
    """Stands in for a world (``world.World``): records the jobs it was asked to run."""

    def __init__(self, world_size: int = 2, accelerator: str = "cpu"):
        self.world_size, self.accelerator, self.requests = world_size, accelerator, []

    def run(self, request):
        from pytest_ltconform.world import JobResult, RankOutcome

        self.requests.append(request)
        return JobResult("ok", [RankOutcome(0, "ok", value={}), RankOutcome(1, "ok", value={})], 0.1, 2)

    def close(self) -> None:
        pass


class _RecordingPool:
    """Stands in for the world pool: records which local world each run asked for."""

    fresh_per_job = False

    def __init__(self):
        self.backends, self.world = [], _RecordingWorld()

    def get(self, world_size: int, backend: str = "gloo", pg_timeout_s: float = 30.0, env: dict | None = None):
        self.backends.append(backend)
        return self.world


def test_session_sends_each_tier_to_its_world():
    from pytest_ltconform import contracts
    from pytest_ltconform.session import LtconformSession
    from pytest_ltconform.settings import Settings

    pool, attached = _RecordingPool(), _RecordingWorld()
    session = LtconformSession(Settings(target="x"), target=None, pool=pool)
    session.attached = attached
    launch = contracts.get_contract("launch-env").run_spec
    session.run_for(launch, "ddp", "cpu")
    session.run_for(launch, "ddp", "gpu")
    session.run_for(launch, "deepspeed", "deepspeed")
    session.run_for(launch, "ddp", "multinode")
    session.run_for(launch, "ddp", "gpu")  # cached
    assert pool.backends == ["gloo", "nccl", "nccl"] and len(pool.world.requests) == 3
    assert len(attached.requests) == 1 and attached.requests[0].fn.endswith("harness:inspect")


def test_xdist_workers_cannot_share_a_rank_of_a_launched_world(pytester, monkeypatch):
    env = {"TORCHELASTIC_RUN_ID": "none", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "GROUP_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    result = pytester.runpytest("--ltconform", BORING, "-n", "2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*pytest is rank 0 of a torchrun world of 2 ranks; pytest-xdist workers (-n)*"])
    # A -m that deselects every contract item still attaches to the launched world (its ranks must
    # collect alike, its ltconform_world fixture is that world): the same error, not a local world.
    deselected = pytester.runpytest("--ltconform", BORING, "-m", "not ltconform", "-n", "2")
    assert deselected.ret == pytest.ExitCode.USAGE_ERROR
    deselected.stderr.fnmatch_lines(["*pytest is rank 0 of a torchrun world of 2 ranks; pytest-xdist workers (-n)*"])
