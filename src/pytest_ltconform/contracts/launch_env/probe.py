"""launch-env, rank side: what its probe observes on every rank (the package's docstring says
what the verdict makes of it).
"""

from __future__ import annotations

import os
from typing import Any

from ...runs import Probe

# Launcher variables a rank reports; nothing else of its environment leaves the rank.
ENV_KEYS = (
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "NCCL_TIMEOUT",
    "SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES",
    "SLURM_JOB_NUM_NODES", "SLURM_NODEID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODELIST",
    "SLURM_TASKS_PER_NODE", "SLURMD_NODENAME",
)

def _count(value: Any) -> int | None:
    """devices / num_nodes as a number of processes or nodes; None for 'auto' and the like."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    if isinstance(value, (list, tuple)):
        return len(value)
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit():
            return int(text) or None
        if "," in text:
            return len([p for p in text.split(",") if p.strip()])
    return None

def _strategy_timeout(strategy: Any) -> float | None:
    """The process-group timeout a strategy object sets explicitly (seconds), else None."""
    timeout = getattr(strategy, "_timeout", None)
    if timeout is None or isinstance(strategy, str):
        return None
    try:
        from torch.distributed.constants import default_pg_timeout

        if timeout == default_pg_timeout:
            return None
    except ImportError:
        pass
    return float(timeout.total_seconds())

def _simulated(module) -> list[dict] | None:
    raw = getattr(module, "LAUNCH_ENV", None)
    if not isinstance(raw, dict):
        return None
    out = []
    for node in sorted(raw):
        envs = raw[node] if isinstance(raw[node], (list, tuple)) else [raw[node]]
        out += [{k: str(v) for k, v in dict(e).items()} for e in envs]
    return out

def _assignment_site(module, name: str) -> dict | None:
    """Where ``name = ...`` is written at the top level of ``module``'s source file."""
    import ast

    path = getattr(module, "__file__", None)
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
    except (OSError, TypeError, SyntaxError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return {"file": path, "line": node.lineno, "func": name}
    return None

def _trainer_site(targets) -> dict | None:
    """Where the user's Trainer kwargs (``--ltconform-trainer``) are defined."""
    import inspect

    from ...target import loading as target_loading

    if not targets.trainer:
        return None
    try:
        obj = target_loading.load_object(targets.trainer)
        if callable(obj):
            path, line = inspect.getsourcefile(obj), inspect.getsourcelines(obj)[1]
            return {"file": path, "line": line, "func": getattr(obj, "__qualname__", "trainer kwargs")}
        return _assignment_site(target_loading.import_module(targets.trainer), targets.trainer.attr)
    except Exception:
        return None

def _resolved(run) -> dict:
    """The world as Lightning's Trainer reads it on this rank of a local world of several nodes:
    the user's Trainer kwargs as every run merges them (num_nodes and devices the layout's), built
    without fitting. ``{"error": ...}`` when the Trainer cannot be built from them."""
    try:
        user_strategy = run.objects.user_kwargs.get("strategy")
        kwargs = run.trainer_kwargs(run.strategy("ddp", user_strategy))
        trainer = run.objects.ns.Trainer(**kwargs)
    except Exception as exc:  # the user's kwargs: what Lightning said is the finding
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
    env = trainer.strategy.cluster_environment
    return {"global_rank": trainer.global_rank, "local_rank": trainer.local_rank, "node_rank": trainer.node_rank,
            "world_size": trainer.world_size, "num_nodes": trainer.num_nodes, "devices": trainer.num_devices,
            "environment": type(env).__name__ if env is not None else None}


class LaunchEnvProbe(Probe):
    def inspect(self, run) -> dict:
        """This rank's launcher variables and the user's Trainer world settings:
        ``{"kind", "env", "trainer", "simulated", "simulated_site", "trainer_site"}``, where ``kind``
        is 'attached' or 'local' (ranks the plugin spawned)."""
        from ...target import loading as target_loading

        targets = run.target
        user = target_loading.user_trainer_kwargs(targets)
        module = target_loading.import_module(targets.model)
        strategy = user.get("strategy")
        return {
            "kind": run.ctx.world_kind,
            "nodes": run.ctx.num_nodes,
            "resolved": _resolved(run) if run.ctx.world_kind == "local" and run.ctx.num_nodes > 1 else None,
            "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ},
            "trainer": {"num_nodes": _count(user.get("num_nodes")), "devices": _count(user.get("devices")),
                        "devices_raw": repr(user.get("devices")) if "devices" in user else None,
                        "strategy": strategy if isinstance(strategy, str) or strategy is None
                        else type(strategy).__name__,
                        "timeout_s": _strategy_timeout(strategy)},
            "simulated": _simulated(module),
            "simulated_site": _assignment_site(module, "LAUNCH_ENV"),
            "trainer_site": _trainer_site(targets),
        }
