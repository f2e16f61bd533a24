"""Typed boundaries: what a job carries to its ranks (one ``RunArgs``), how ranks come to be (one
``Launcher`` protocol, one implementation per module, no capability probed for), what a tier is
(one class per tier answering the same questions) and what a target is (spec, loading and
validation apart, no aliases). No rank process is started here."""

from __future__ import annotations

import ast
import importlib
import pathlib
import pickle
import types

import pytest

SRC = pathlib.Path(__file__).parents[1] / "src" / "pytest_ltconform"


def _modules(folder: pathlib.Path):
    for path in sorted(folder.rglob("*.py")):
        yield path, ast.parse(path.read_text())


# -- what a job carries ---------------------------------------------------------------------------

class _Recorder:
    """A world and a pool in one: records each request and answers with a finished two-rank job."""

    fresh_per_job = False
    world_size = 2

    def __init__(self):
        self.requests, self.asked = [], []

    def get(self, layout, backend="gloo", pg_timeout_s=30.0, env=None):
        self.asked.append((layout, backend, env))
        return self

    def run(self, request):
        from pytest_ltconform.world import JobResult, RankOutcome

        self.requests.append(request)
        return JobResult("ok", [RankOutcome(0, "ok", value={}), RankOutcome(1, "ok", value={})], 0.1, 2)


def test_a_run_job_carries_one_run_args_with_the_target_strategy_probes_and_layout():
    from pytest_ltconform import contracts
    from pytest_ltconform.runs import FIT, RunArgs
    from pytest_ltconform.session import LtconformSession
    from pytest_ltconform.settings import Settings
    from pytest_ltconform.world.layout import Layout

    pool = _Recorder()
    settings = Settings(target="m.Model", world_size=2)
    target = types.SimpleNamespace(id="t", model_name="M")  # what the session was given travels as it is
    session = LtconformSession(settings, target, pool=pool)
    session.run_for(FIT, "fsdp", "cpu")
    (request,) = pool.requests
    (args,) = request.args
    assert isinstance(args, RunArgs) and request.fn == FIT.fn
    assert (args.target, args.strategy, args.pg_timeout_s) == (target, "fsdp", settings.pg_timeout_s)
    assert args.probes == tuple(contracts.probes_for(FIT)) and args.probes
    assert args.layout == Layout(1, 2) and pool.asked == [(Layout(1, 2), "gloo", {"DS_ACCELERATOR": "cpu"})]


def test_run_args_pickle_and_a_reference_runs_one_rank_without_probes():
    from pytest_ltconform.runs import RunArgs
    from pytest_ltconform.world.layout import Layout

    args = RunArgs("target", "ddp", (("sync-dist", "m:Probe"),), 12.5, Layout(1, 2))
    assert pickle.loads(pickle.dumps(args)) == args
    ref = args.for_reference()
    assert (ref.target, ref.strategy, ref.pg_timeout_s, ref.probes, ref.layout) == \
        ("target", "ddp", 12.5, (), Layout(1, 1))


def test_references_are_resolved_in_one_place_and_the_rank_run_keeps_no_strategy_name_of_its_own():
    from pytest_ltconform import harness
    from pytest_ltconform.world import job, rank

    assert harness.resolve is job.resolve and not hasattr(rank, "_resolve")
    assert job.resolve("pytest_ltconform.world.layout:Layout.single_node")(3).ranks_per_node == 3
    run = harness.RankRun(None, _args(), {}, None)
    assert run.args.strategy == "deepspeed" and not hasattr(run, "strategy_name")


def _args():
    from pytest_ltconform.runs import RunArgs

    return RunArgs(None, "deepspeed")


def test_every_run_function_takes_the_rank_context_and_one_run_args():
    # RunSpec.fn and RunSpec.reference of every built-in run: fn(ctx, args), reference(ctx, args, *saved).
    import inspect

    from pytest_ltconform import contracts
    from pytest_ltconform.world.job import resolve

    specs = {contracts.get_contract(cid).run_spec for cid in contracts.ids()}
    for spec in specs:
        params = list(inspect.signature(resolve(spec.fn)).parameters)
        assert params[:2] == ["ctx", "args"], (spec.fn, params)
        if spec.reference:
            assert list(inspect.signature(resolve(spec.reference)).parameters)[:2] == ["ctx", "args"], spec


# -- how ranks come to be ---------------------------------------------------------------------------

def test_each_launcher_is_one_class_in_its_own_module_answering_the_launcher_protocol():
    from pytest_ltconform.world.launch import attached, base, fork, spawn

    for module, cls in ((fork, fork.ForkLauncher), (spawn, spawn.SpawnLauncher), (attached, attached.AttachedLauncher)):
        assert cls.__module__ == module.__name__ and base.Launcher in cls.__mro__
        assert [c for c in vars(module).values() if isinstance(c, type) and base.Launcher in c.__mro__
                and c is not base.Launcher] == [cls]
    kinds = {fork.ForkLauncher(()).kind, spawn.SpawnLauncher().kind, attached.AttachedLauncher(None).kind}
    assert kinds == {"fork", "spawn", "attached"}


def test_a_launcher_without_a_parent_answers_none_for_what_only_a_parent_does():
    from pytest_ltconform.world.launch.spawn import SpawnLauncher

    launcher = SpawnLauncher()
    assert launcher.store({}, "/nonexistent") is None
    assert launcher.fresh("m:f", [], env={}, cwd=".", folder=".", timeout_s=1.0, parent_env={}) is None
    assert launcher.import_now(["json"], {}, ".") is None


def test_an_attached_launcher_starts_no_rank_and_says_who_does():
    from pytest_ltconform.tiers import Attached
    from pytest_ltconform.world.launch.attached import AttachedLauncher
    from pytest_ltconform.world.launch.base import LaunchError

    info = Attached(launcher="torchrun", environment="TorchElasticEnvironment", rank=1, world_size=4, local_rank=1,
                    node_rank=0, main_address="127.0.0.1", main_port=1, agent_store=True)
    with pytest.raises(LaunchError, match="rank 1 of a torchrun world of 4 ranks: its ranks are started by torchrun"):
        AttachedLauncher(info).start({}, "/dev/null", ".")


def test_no_launcher_is_probed_for_a_capability():
    for path, tree in _modules(SRC / "world"):
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("hasattr", "getattr") and node.args:
                assert "launcher" not in ast.unparse(node.args[0]), f"{path}:{node.lineno}"


# -- layouts ----------------------------------------------------------------------------------------

def test_a_layout_numbers_ranks_as_torchrun_does():
    from pytest_ltconform.world.layout import Layout

    two_by_three = Layout(2, 3)
    assert two_by_three.world_size == 6 and str(two_by_three) == "2x3"
    assert [(two_by_three.node_rank(r), two_by_three.local_rank(r)) for r in range(6)] == \
        [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert Layout.single_node(4) == Layout(1, 4)
    with pytest.raises(ValueError, match="at least 1 node of at least 1 rank, got 0 x 2"):
        Layout(0, 2)


def test_a_local_world_takes_its_layout_as_a_value_and_its_rank_variables_from_it():
    # No rank starts: the world's variables are what a rank would be started with.
    from pytest_ltconform.world.layout import Layout
    from pytest_ltconform.world.local import LocalWorld

    world = LocalWorld(layout=Layout(1, 3), preload=(), launcher="spawn")
    try:
        assert world.world_size == 3
        env = world._rank_env(2)
        assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "GROUP_WORLD_SIZE",
                                    "LOCAL_WORLD_SIZE", "WORLD_SIZE")} == \
            {"RANK": "2", "LOCAL_RANK": "2", "NODE_RANK": "0", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
             "LOCAL_WORLD_SIZE": "3", "WORLD_SIZE": "3"}
    finally:
        world.close()
    assert LocalWorld(2, preload=(), launcher="spawn").layout == Layout(1, 2)
    # Several nodes on this host: torchrun's numbering, and each node's own temp folder.
    world = LocalWorld(layout=Layout(2, 2), preload=(), launcher="spawn")
    try:
        env = world._rank_env(3)
        assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "GROUP_WORLD_SIZE",
                                    "LOCAL_WORLD_SIZE", "WORLD_SIZE")} == \
            {"RANK": "3", "LOCAL_RANK": "1", "NODE_RANK": "1", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
             "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"}
        assert env["TMPDIR"] == env["SLURM_TMPDIR"] != world._rank_env(0)["TMPDIR"]
    finally:
        world.close()


# -- tiers ------------------------------------------------------------------------------------------

def test_every_tier_is_one_class_in_its_own_module_answering_the_same_questions():
    from pytest_ltconform import controller, tiers, vocabulary
    from pytest_ltconform.tiers.base import Tier

    assert sorted(t.name for t in tiers.ORDER) == sorted(vocabulary.TIERS)
    for name in vocabulary.TIERS:
        tier = tiers.get(name)
        assert type(tier).__module__ == f"pytest_ltconform.tiers.{name}" and isinstance(tier, Tier)
        assert tier.marker() in controller.MARKERS
        for question in ("missing", "variants", "world", "marker", "layout"):
            assert callable(getattr(tier, question))
    with pytest.raises(ValueError, match="unknown tier 'tpu'"):
        tiers.get("tpu")


def test_each_tier_sends_its_runs_to_its_own_world():
    from pytest_ltconform import tiers
    from pytest_ltconform.world import WorldStartError
    from pytest_ltconform.world.layout import Layout

    pool, attached = _Recorder(), object()
    for name, backend, env in (("cpu", "gloo", {"DS_ACCELERATOR": "cpu"}), ("gpu", "nccl", {}),
                               ("deepspeed", "nccl", {})):
        tier = tiers.get(name)
        assert tier.world(pool, attached, tier.layout(2), 30.0) is pool
        assert pool.asked[-1] == (Layout(1, 2), backend, env)
        assert tier.reference_world(pool, 30.0) is pool and pool.asked[-1] == (Layout(1, 1), "gloo",
                                                                                {"DS_ACCELERATOR": "cpu"})
    multinode = tiers.get("multinode")
    assert multinode.layout(2) is None and multinode.world(pool, attached, None, 30.0) is attached
    assert multinode.reference_world(pool, 30.0) is None
    with pytest.raises(WorldStartError, match="only inside a torchrun or SLURM world"):
        multinode.world(pool, None, None, 30.0)


def test_no_module_outside_the_tiers_package_branches_on_a_tier_name():
    from pytest_ltconform.vocabulary import TIERS

    def names_a_tier(test) -> bool:
        for node in ast.walk(test):
            if isinstance(node, ast.Compare) and "tier" in ast.unparse(node.left):
                consts = [c for c in ast.walk(node) if isinstance(c, ast.Constant)]
                if any(c.value in TIERS for c in consts):
                    return True
        return False

    for path, tree in _modules(SRC):
        if "tiers" in path.relative_to(SRC).parts:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.If, ast.IfExp)):
                assert not names_a_tier(node.test), f"{path}:{node.lineno}: {ast.unparse(node.test)}"


# -- targets ----------------------------------------------------------------------------------------

def test_a_target_is_spec_loading_and_validation_with_no_alias_and_the_harness_re_exports_nothing():
    from pytest_ltconform import harness, runs
    from pytest_ltconform.target import loading, spec, validation

    assert not hasattr(spec, "Targets") and not hasattr(spec, "TargetSpec")
    assert spec.ResolvedTarget.__module__ == spec.__name__ and validation.validate.__module__ == validation.__name__
    assert loading.load_object.__module__ == loading.__name__
    for name in ("FIT", "FIT_WITHOUT_VALIDATION", "RunSpec", "inspection"):
        assert not hasattr(harness, name), name
    import pytest_ltconform

    assert pytest_ltconform.FIT is runs.FIT and pytest_ltconform.Probe is runs.Probe
    assert pytest_ltconform.Target is spec.Target and pytest_ltconform.ResolvedTarget is spec.ResolvedTarget
    # The spec imports nothing of the user's code, torch or Lightning: conftest files import it.
    assert not {m for m in _imported(SRC / "target" / "spec.py") if m.startswith((".", "torch", "lightning"))}


def _imported(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


@pytest.mark.parametrize("module", ["target", "target.spec", "target.loading", "target.validation", "tiers",
                                    "world.launch", "world.layout", "runs"])
def test_the_new_modules_import_without_torch(module):
    # A fresh interpreter, so that what this process imported already says nothing.
    import subprocess
    import sys

    code = (f"import sys, importlib; importlib.import_module('pytest_ltconform.{module}'); "
            f"print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    importlib.import_module(f"pytest_ltconform.{module}")
