"""launch-env: the launcher's world agrees with the Trainer, and every rank agrees with the others.

Seed section "Multi-node launch" (and "Choose using measured memory" for the timeout): setting
``num_nodes`` allocates no hosts and opens no ports; the launcher (torchrun, srun, or a hand-set
MASTER_ADDR/MASTER_PORT/NODE_RANK) makes the world, and the Trainer's ``num_nodes`` x ``devices``
must describe exactly that world. The process-group timeout comes from the strategy
(``DDPStrategy(timeout=...)``), not from NCCL_TIMEOUT.

Checked from what every rank's environment says (no fit needed):

- the world size every rank sees (WORLD_SIZE; SLURM_NTASKS under SLURM) is the same on every
  rank, equals the number of processes that were really started, and equals num_nodes x devices;
- node ranks, MASTER_ADDR and MASTER_PORT (as Lightning resolves them) agree across ranks;
  a NODE_RANK exported next to the launcher's own node rank agrees with it;
- under SLURM: the processes per node equal SLURM_NTASKS_PER_NODE and the Trainer's devices, and
  SLURM_NTASKS equals SLURM_NNODES x SLURM_NTASKS_PER_NODE;
- NCCL_TIMEOUT set while the strategy leaves the timeout at its default fails.

It judges a world pytest is attached to (the multinode tier). In a world of ranks the plugin
spawned itself there is no launch to judge, and the item skips; a module (such as a conformance
case) may define ``LAUNCH_ENV = {node_rank: env or [env, ...]}``, a recorded launch environment
per node, which is then judged instead.
"""

from __future__ import annotations

import os
from typing import Any

from ..harness import Probe, inspection
from ..sites import fmt_site
from .base import Contract, Evidence, Run, Verdict

# Launcher variables a rank reports; nothing else of its environment leaves the rank.
ENV_KEYS = (
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "NCCL_TIMEOUT",
    "SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES",
    "SLURM_JOB_NUM_NODES", "SLURM_NODEID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODELIST",
    "SLURM_TASKS_PER_NODE", "SLURMD_NODENAME",
)
_INTERACTIVE_JOB_NAMES = ("bash", "interactive")


# -- rank side -----------------------------------------------------------------------------------

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

    from .. import target as target_mod

    if not targets.trainer:
        return None
    try:
        obj = target_mod.load_object(targets.trainer)
        if callable(obj):
            path, line = inspect.getsourcefile(obj), inspect.getsourcelines(obj)[1]
            return {"file": path, "line": line, "func": getattr(obj, "__qualname__", "trainer kwargs")}
        return _assignment_site(target_mod.import_module(targets.trainer), targets.trainer.attr)
    except Exception:
        return None


class LaunchEnvProbe(Probe):
    def inspect(self, run) -> dict:
        """This rank's launcher variables and the user's Trainer world settings:
        ``{"kind", "env", "trainer", "simulated", "simulated_site", "trainer_site"}``, where ``kind``
        is 'attached' or 'local' (ranks the plugin spawned)."""
        from .. import target as target_mod

        targets = run.targets
        user = target_mod.trainer_kwargs(targets.trainer) if targets.trainer else {}
        module = target_mod.import_module(targets.model)
        strategy = user.get("strategy")
        return {
            "kind": run.ctx.world_kind,
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


# -- pytest side ---------------------------------------------------------------------------------

def _int(value: Any) -> int | None:
    """Leading integer of a launcher value ('2(x2)' -> 2); None when absent or not a number."""
    if value is None:
        return None
    digits = ""
    for ch in str(value).strip():
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if digits else None


def launcher_of(env: dict) -> str:
    """'torchrun', 'slurm', 'slurm-interactive' or 'manual' (MASTER_*/NODE_RANK set by hand)."""
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if "SLURM_NTASKS" in env:
        return "slurm-interactive" if env.get("SLURM_JOB_NAME") in _INTERACTIVE_JOB_NAMES else "slurm"
    return "manual"


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list ('n[1-2],m3' -> 'n1'), as Lightning picks the root node."""
    head = nodelist.split(" ")[0].split(",")[0]
    if "[" in nodelist.split(",")[0]:
        prefix, rest = nodelist.split("[", 1)
        first = rest.split("]")[0].split(",")[0].split("-")[0]
        return prefix + first
    return head


def view(env: dict, index: int) -> dict:
    """One process's world as its launcher describes it (the values Lightning would use)."""
    launcher = launcher_of(env)
    if launcher.startswith("slurm"):
        job = env.get("SLURM_JOB_ID")
        port = env.get("MASTER_PORT") or (str(15000 + int(job[-4:])) if job and job[-4:].isdigit() else "12910")
        return {"launcher": launcher, "index": index, "world_size": _int(env.get("SLURM_NTASKS")),
                "world_var": "SLURM_NTASKS", "rank": _int(env.get("SLURM_PROCID")),
                "local_rank": _int(env.get("SLURM_LOCALID")), "node_rank": _int(env.get("SLURM_NODEID")),
                "node_var": "SLURM_NODEID",
                "master_addr": env.get("MASTER_ADDR") or first_host(env.get("SLURM_NODELIST", "127.0.0.1")),
                "master_port": port, "env": env}
    node_var = "GROUP_RANK" if launcher == "torchrun" else "NODE_RANK"
    return {"launcher": launcher, "index": index, "world_size": _int(env.get("WORLD_SIZE")), "world_var": "WORLD_SIZE",
            "rank": _int(env.get("RANK")), "local_rank": _int(env.get("LOCAL_RANK")),
            "node_rank": _int(env.get(node_var, "0")), "node_var": node_var,
            "master_addr": env.get("MASTER_ADDR"), "master_port": env.get("MASTER_PORT"), "env": env}


def check(views: list[dict], trainer: dict) -> tuple[list[tuple[str, int | None, str]], list[str], dict]:
    """Judge a launch: ``views`` (one per started process, from :func:`view`) against the user's
    Trainer settings ``trainer`` (``num_nodes``, ``devices``: numbers or None, ``timeout_s``).

    Returns (problems as (category, rank or None, detail), notes, layout facts).
    """
    problems: list[tuple[str, int | None, str]] = []
    notes: list[str] = []

    def who(v: dict) -> int:
        return v["rank"] if v["rank"] is not None else v["index"]

    per_node: dict[int | None, int] = {}
    for v in views:
        per_node[v["node_rank"]] = per_node.get(v["node_rank"], 0) + 1
    nodes_seen = len(per_node)
    counts = sorted(set(per_node.values()))
    procs_per_node = counts[-1]
    if len(counts) > 1:
        listing = ", ".join(f"node {n}: {c}" for n, c in sorted(per_node.items(), key=lambda kv: str(kv[0])))
        problems.append(("deadlock", None, f"nodes run different numbers of processes ({listing}); "
                                           f"Lightning assumes devices processes on every node"))
    num_nodes = trainer.get("num_nodes") or nodes_seen
    devices = trainer.get("devices") or procs_per_node
    unset = [k for k in ("num_nodes", "devices") if not trainer.get(k)]
    if unset:
        why = (f"Lightning's default num_nodes=1 under a launch of {nodes_seen} nodes shards the data for the "
               f"wrong world" if "num_nodes" in unset and nodes_seen > 1 else
               "devices='auto' takes every visible device of a node, which need not match the tasks per node")
        notes.append(f"your Trainer kwargs do not set {' and '.join(unset)}; judged with num_nodes={num_nodes} "
                     f"and devices={devices} as launched. Set them in the production Trainer: {why}.")

    # 1. world size: the same everywhere, the processes that exist, and num_nodes x devices.
    var = views[0]["world_var"]
    sizes = {who(v): v["world_size"] for v in views}
    distinct = sorted(set(sizes.values()), key=str)
    if len(distinct) > 1:
        listing = ", ".join(f"rank {r}: {s}" for r, s in sorted(sizes.items()))
        problems.append(("deadlock", None, f"{var} differs across ranks ({listing})"))
    world = distinct[0]
    if world is not None and world != len(views):
        problems.append(("deadlock", None, f"{var}={world} but {len(views)} processes were started "
                                           f"({nodes_seen} node(s) x {procs_per_node})"))
    if world is not None and world != num_nodes * devices:
        problems.append(("silent", None, f"{var}={world} but num_nodes {num_nodes} x devices {devices} = "
                                         f"{num_nodes * devices}"))

    # 2. rendezvous values and node ranks agree.
    for key, label in (("master_addr", "MASTER_ADDR"), ("master_port", "MASTER_PORT")):
        values = {who(v): v[key] for v in views}
        if len(set(values.values())) > 1:
            listing = ", ".join(f"rank {r}: {val}" for r, val in sorted(values.items()))
            problems.append(("deadlock", None, f"{label} differs across ranks ({listing}); every rank must "
                                               f"rendezvous at the same address"))
    if trainer.get("num_nodes") and nodes_seen != trainer["num_nodes"]:
        node_var = views[0]["node_var"]
        seen = ", ".join(map(str, sorted(per_node, key=str)))
        if nodes_seen < trainer["num_nodes"]:
            problems.append(("deadlock", None, f"the Trainer has num_nodes={trainer['num_nodes']} but the processes "
                                               f"report {nodes_seen} distinct {node_var} value(s) ({seen}); every "
                                               f"node needs its own {node_var}"))
        else:
            problems.append(("silent", None, f"the launch spans {nodes_seen} nodes ({node_var} {seen}) but the "
                                             f"Trainer has num_nodes={trainer['num_nodes']}"))
    seats = [(v["node_rank"], v["local_rank"]) for v in views if v["local_rank"] is not None]
    doubled = sorted({s for s in seats if seats.count(s) > 1}, key=str)
    if doubled:
        problems.append(("deadlock", None, "several processes claim the same (node rank, local rank): "
                                           + ", ".join(f"{n}/{lr}" for n, lr in doubled)))
    ranks = sorted(who(v) for v in views)
    if world is not None and ranks != list(range(len(views))):
        problems.append(("deadlock", None, f"global ranks are {ranks}, not 0..{len(views) - 1} once each"))
    node_ranks = sorted(n for n in per_node if n is not None)
    if node_ranks != list(range(nodes_seen)):
        problems.append(("deadlock", None, f"node ranks are {node_ranks}, not 0..{nodes_seen - 1}"))
    for v in views:
        exported = _int(v["env"].get("NODE_RANK"))
        if v["node_var"] != "NODE_RANK" and exported is not None and exported != v["node_rank"]:
            problems.append(("deadlock", who(v), f"NODE_RANK={exported} but the launcher's "
                                                 f"{v['node_var']}={v['node_rank']}"))

    # 3. SLURM's task layout.
    env0 = views[0]["env"]
    if views[0]["launcher"].startswith("slurm"):
        if views[0]["launcher"] == "slurm-interactive" and len(views) > 1:
            problems.append(("deadlock", None, f"SLURM_JOB_NAME={env0.get('SLURM_JOB_NAME')} makes Lightning "
                                               f"treat this {len(views)}-task job as an interactive shell: every "
                                               f"task takes global rank 0"))
        per_node_var = _int(env0.get("SLURM_NTASKS_PER_NODE"))
        nnodes = _int(env0.get("SLURM_NNODES") or env0.get("SLURM_JOB_NUM_NODES"))
        ntasks = _int(env0.get("SLURM_NTASKS"))
        if per_node_var is None and ntasks and ntasks > 1:
            problems.append(("deadlock", None, f"SLURM_NTASKS={ntasks} without SLURM_NTASKS_PER_NODE: "
                                               f"launch with --ntasks-per-node, not --ntasks"))
        if per_node_var is not None:
            if per_node_var != procs_per_node:
                problems.append(("silent", None, f"SLURM_NTASKS_PER_NODE={per_node_var} but {procs_per_node} "
                                                 f"process{'es' if procs_per_node != 1 else ''} per node "
                                                 f"(devices={devices})"))
            elif per_node_var != devices:
                problems.append(("silent", None, f"SLURM_NTASKS_PER_NODE={per_node_var} but the Trainer has "
                                                 f"devices={devices}"))
            if nnodes is not None and ntasks is not None and ntasks != nnodes * per_node_var:
                problems.append(("silent", None, f"SLURM_NTASKS={ntasks} != SLURM_NNODES {nnodes} x "
                                                 f"SLURM_NTASKS_PER_NODE {per_node_var} = {nnodes * per_node_var}"))
        if nnodes is not None and nnodes != num_nodes:
            problems.append(("silent", None, f"SLURM_NNODES={nnodes} but the Trainer has num_nodes={num_nodes}"))

    # 4. the timeout belongs to the strategy.
    nccl = {who(v): v["env"]["NCCL_TIMEOUT"] for v in views if "NCCL_TIMEOUT" in v["env"]}
    if nccl:
        value = next(iter(nccl.values()))
        if trainer.get("timeout_s"):
            notes.append(f"NCCL_TIMEOUT={value} is set but has no effect; the strategy's timeout "
                         f"({trainer['timeout_s']:g} s) is the one in force.")
        else:
            problems.append(("silent", None, f"NCCL_TIMEOUT={value} is set on rank(s) "
                                             f"{', '.join(map(str, sorted(nccl)))} while the strategy "
                                             f"keeps its default process-group timeout"))
    layout = {"launcher": views[0]["launcher"], "nodes": nodes_seen, "per_node": procs_per_node,
              "world": world, "var": var, "num_nodes": num_nodes, "devices": devices,
              "master": f"{views[0]['master_addr']}:{views[0]['master_port']}"}
    return problems, notes, layout


_FIX = {
    "size": "launch exactly num_nodes x devices processes, devices per node (srun --nodes=N "
            "--ntasks-per-node=D, or torchrun --nnodes N --nproc-per-node D on every node), and give the "
            "Trainer the same num_nodes=N and devices=D",
    "rendezvous": "let the launcher set MASTER_ADDR, MASTER_PORT and the node rank, or export the same "
                  "MASTER_ADDR/MASTER_PORT on every node and a distinct NODE_RANK per node",
    "timeout": "set the process-group timeout on the strategy, e.g. DDPStrategy(timeout=timedelta(minutes=30)), "
               "and drop NCCL_TIMEOUT",
}


class LaunchEnv(Contract):
    id = "launch-env"
    title = "The launched world matches the Trainer's num_nodes x devices, and every rank agrees"
    seed = "Multi-node launch"
    run_spec = inspection("launch")
    probe_class = LaunchEnvProbe
    strategies = ("ddp",)
    tiers = ("multinode",)

    def judge(self, run: Run) -> Verdict:
        observed = [o for o in run.probe(self.id) if o]
        if not observed:
            return self.verdict("error", "no rank reported its launch environment.")
        trainer = observed[0]["trainer"]
        launch_site = None
        if all(o["kind"] == "attached" for o in observed):
            envs, source = [o["env"] for o in observed], "as every rank saw it"
        elif observed[0].get("simulated"):
            envs, source = observed[0]["simulated"], "from the module's recorded LAUNCH_ENV"
            launch_site = fmt_site(observed[0].get("simulated_site")) if observed[0].get("simulated_site") else None
        else:
            return self.verdict(
                "skipped", "not inside a multi-node world: these ranks were started by pytest-ltconform "
                           "itself, so there is no torchrun or SLURM launch to check (run pytest under "
                           "torchrun or srun and select -m ltconform_multinode).")
        views = [view(env, i) for i, env in enumerate(envs)]
        problems, notes, layout = check(views, trainer)
        where = f"{layout['launcher']} launch of {layout['nodes']} node(s) x {layout['per_node']} process(es)"
        if not problems:
            summary = (f"the {where} matches the Trainer: {layout['var']}={layout['world']} = num_nodes "
                       f"{layout['num_nodes']} x devices {layout['devices']}, and every rank agrees on the node "
                       f"ranks and on MASTER {layout['master']} ({source}).")
            return self.verdict("passed", summary, notes=notes)
        evidence = [Evidence(detail, rank=rank, site=launch_site) for _, rank, detail in problems]
        trainer_site = observed[0].get("trainer_site")
        if trainer_site and (trainer.get("num_nodes") or trainer.get("devices")):
            evidence.append(Evidence(f"the Trainer kwargs (num_nodes={trainer.get('num_nodes') or 'unset'}, devices="
                                     f"{trainer.get('devices_raw') or 'unset'}, strategy={trainer.get('strategy')}) "
                                     f"come from here", site=fmt_site(trainer_site)))
        kinds = set()
        for _, _, detail in problems:
            rendezvous = ("MASTER_", "NODE_RANK", "node ranks", "global ranks", "claim", "interactive")
            kinds.add("timeout" if "NCCL_TIMEOUT" in detail else
                      "rendezvous" if any(w in detail for w in rendezvous) else "size")
        fix = "; ".join(_FIX[k] for k in ("size", "rendezvous", "timeout") if k in kinds) + "."
        summary = (f"the {where} disagrees with the Trainer or across ranks ({source}): {problems[0][2]}"
                   + (f"; and {len(problems) - 1} more finding(s) below" if len(problems) > 1 else "") + ".")
        return self.verdict("failed", summary, evidence=evidence, fix=fix, category=problems[0][0], notes=notes)


CONTRACT = LaunchEnv()
