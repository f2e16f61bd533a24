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

import dataclasses
from typing import Any

from ...outcomes import Outcome
from ...runs import inspection
from ...sites import fmt_site
from ..base import Contract, Evidence, Findings, Run, Verdict
from .probe import LaunchEnvProbe

_INTERACTIVE_JOB_NAMES = ("bash", "interactive")

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

def first_host(nodelist: str) -> str:
    """First host of a SLURM node list ('n[1-2],m3' -> 'n1'), as Lightning picks the root node."""
    head = nodelist.split(" ")[0].split(",")[0]
    if "[" in nodelist.split(",")[0]:
        prefix, rest = nodelist.split("[", 1)
        first = rest.split("]")[0].split(",")[0].split("-")[0]
        return prefix + first
    return head

def _who(v: dict) -> int:
    return v["rank"] if v["rank"] is not None else v["index"]

def _sizes(views: list[dict]) -> dict:
    """rank -> the world size its launcher gives (a later process claiming the same rank wins)."""
    return {_who(v): v["world_size"] for v in views}

@dataclasses.dataclass
class _Layout:
    """The world the started processes make, and the Trainer's settings (filled from it when unset)."""

    per_node: dict  # node rank -> processes started on it
    nodes: int
    procs_per_node: int
    world: int | None  # the world size the first rank's launcher variable gives
    var: str
    num_nodes: int
    devices: int

    @classmethod
    def of(cls, views: list[dict], trainer: dict) -> _Layout:
        per_node: dict[int | None, int] = {}
        for v in views:
            per_node[v["node_rank"]] = per_node.get(v["node_rank"], 0) + 1
        procs_per_node = max(per_node.values())
        world = sorted(set(_sizes(views).values()), key=str)[0]
        return cls(per_node, len(per_node), procs_per_node, world, views[0]["world_var"],
                   trainer.get("num_nodes") or len(per_node), trainer.get("devices") or procs_per_node)

    def facts(self, first: dict) -> dict:
        return {"launcher": first["launcher"], "nodes": self.nodes, "per_node": self.procs_per_node,
                "world": self.world, "var": self.var, "num_nodes": self.num_nodes, "devices": self.devices,
                "master": f"{first['master_addr']}:{first['master_port']}"}

class _Launcher:
    """A launcher: how it is recognised, the world it describes to one process (the values
    Lightning would use), and the settings only it has. The base class is a manual launch
    (MASTER_ADDR/MASTER_PORT/NODE_RANK exported by hand)."""

    name = "manual"
    node_var = "NODE_RANK"

    @staticmethod
    def detect(env: dict) -> bool:
        return True

    def view(self, env: dict, index: int) -> dict:
        return {"launcher": self.name, "index": index, "world_size": _int(env.get("WORLD_SIZE")),
                "world_var": "WORLD_SIZE", "rank": _int(env.get("RANK")), "local_rank": _int(env.get("LOCAL_RANK")),
                "node_rank": _int(env.get(self.node_var, "0")), "node_var": self.node_var,
                "master_addr": env.get("MASTER_ADDR"), "master_port": env.get("MASTER_PORT"), "env": env}

    def validate_process(self, v: dict, findings: Findings) -> None:
        """Checks of one process's own variables (none for a manual launch)."""

    def validate(self, views: list[dict], layout: _Layout, findings: Findings) -> None:
        """Checks of the launcher's own settings across the launch (none for a manual launch)."""

class _OwnNodeRank(_Launcher):
    """A launcher that sets its own node rank: a NODE_RANK exported next to it must agree."""

    def validate_process(self, v: dict, findings: Findings) -> None:
        exported = _int(v["env"].get("NODE_RANK"))
        if exported is not None and exported != v["node_rank"]:
            findings.add("deadlock", f"NODE_RANK={exported} but the launcher's {v['node_var']}={v['node_rank']}",
                         rank=_who(v))

class _TorchElastic(_OwnNodeRank):
    name = "torchrun"
    node_var = "GROUP_RANK"

    @staticmethod
    def detect(env: dict) -> bool:
        return "TORCHELASTIC_RUN_ID" in env

class _Slurm(_OwnNodeRank):
    name = "slurm"
    node_var = "SLURM_NODEID"

    @staticmethod
    def detect(env: dict) -> bool:
        return "SLURM_NTASKS" in env

    def view(self, env: dict, index: int) -> dict:
        job = env.get("SLURM_JOB_ID")
        port = env.get("MASTER_PORT") or (str(15000 + int(job[-4:])) if job and job[-4:].isdigit() else "12910")
        return {"launcher": self.name, "index": index, "world_size": _int(env.get("SLURM_NTASKS")),
                "world_var": "SLURM_NTASKS", "rank": _int(env.get("SLURM_PROCID")),
                "local_rank": _int(env.get("SLURM_LOCALID")), "node_rank": _int(env.get("SLURM_NODEID")),
                "node_var": self.node_var,
                "master_addr": env.get("MASTER_ADDR") or first_host(env.get("SLURM_NODELIST", "127.0.0.1")),
                "master_port": port, "env": env}

    def validate(self, views: list[dict], layout: _Layout, findings: Findings) -> None:
        """SLURM's task layout: tasks per node, tasks = nodes x tasks per node, nodes = num_nodes."""
        env0 = views[0]["env"]
        per_node = _int(env0.get("SLURM_NTASKS_PER_NODE"))
        nnodes = _int(env0.get("SLURM_NNODES") or env0.get("SLURM_JOB_NUM_NODES"))
        ntasks = _int(env0.get("SLURM_NTASKS"))
        if per_node is None and ntasks and ntasks > 1:
            findings.add("deadlock", f"SLURM_NTASKS={ntasks} without SLURM_NTASKS_PER_NODE: "
                                     f"launch with --ntasks-per-node, not --ntasks")
        if per_node is not None:
            procs = layout.procs_per_node
            if per_node != procs:
                findings.add("silent", f"SLURM_NTASKS_PER_NODE={per_node} but {procs} "
                                       f"process{'es' if procs != 1 else ''} per node "
                                       f"(devices={layout.devices})")
            elif per_node != layout.devices:
                findings.add("silent", f"SLURM_NTASKS_PER_NODE={per_node} but the Trainer has "
                                       f"devices={layout.devices}")
            if nnodes is not None and ntasks is not None and ntasks != nnodes * per_node:
                findings.add("silent", f"SLURM_NTASKS={ntasks} != SLURM_NNODES {nnodes} x "
                                       f"SLURM_NTASKS_PER_NODE {per_node} = {nnodes * per_node}")
        if nnodes is not None and nnodes != layout.num_nodes:
            findings.add("silent", f"SLURM_NNODES={nnodes} but the Trainer has num_nodes={layout.num_nodes}")

class _SlurmInteractive(_Slurm):
    """An srun job named like an interactive shell: Lightning does not treat it as a SLURM launch."""

    name = "slurm-interactive"

    @staticmethod
    def detect(env: dict) -> bool:
        return "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") in _INTERACTIVE_JOB_NAMES

    def validate(self, views: list[dict], layout: _Layout, findings: Findings) -> None:
        if len(views) > 1:
            findings.add("deadlock", f"SLURM_JOB_NAME={views[0]['env'].get('SLURM_JOB_NAME')} makes Lightning "
                                     f"treat this {len(views)}-task job as an interactive shell: every "
                                     f"task takes global rank 0")
        super().validate(views, layout, findings)

# In the order they are tried; the manual launch takes what no launcher claims.
_LAUNCHERS = (_TorchElastic(), _SlurmInteractive(), _Slurm(), _Launcher())

_BY_NAME = {launcher.name: launcher for launcher in _LAUNCHERS}

def _launcher(env: dict) -> _Launcher:
    return next(launcher for launcher in _LAUNCHERS if launcher.detect(env))

def view(env: dict, index: int) -> dict:
    """One process's world as its launcher describes it (the values Lightning would use)."""
    return _launcher(env).view(env, index)

def _check_node_sizes(layout: _Layout, trainer: dict, findings: Findings) -> None:
    """Every node runs the same number of processes; say which Trainer settings were filled in."""
    if len(set(layout.per_node.values())) > 1:
        listing = ", ".join(f"node {n}: {c}" for n, c in sorted(layout.per_node.items(), key=lambda kv: str(kv[0])))
        findings.add("deadlock", f"nodes run different numbers of processes ({listing}); "
                                 f"Lightning assumes devices processes on every node")
    unset = [k for k in ("num_nodes", "devices") if not trainer.get(k)]
    if unset:
        why = (f"Lightning's default num_nodes=1 under a launch of {layout.nodes} nodes shards the data for the "
               f"wrong world" if "num_nodes" in unset and layout.nodes > 1 else
               "devices='auto' takes every visible device of a node, which need not match the tasks per node")
        findings.note(f"your Trainer kwargs do not set {' and '.join(unset)}; judged with num_nodes="
                      f"{layout.num_nodes} and devices={layout.devices} as launched. Set them in the production "
                      f"Trainer: {why}.")

def _check_world_size(views: list[dict], layout: _Layout, findings: Findings) -> None:
    """The world size is the same everywhere, the processes that exist, and num_nodes x devices."""
    var, world = layout.var, layout.world
    sizes = _sizes(views)
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"rank {r}: {s}" for r, s in sorted(sizes.items()))
        findings.add("deadlock", f"{var} differs across ranks ({listing})")
    if world is not None and world != len(views):
        findings.add("deadlock", f"{var}={world} but {len(views)} processes were started "
                                 f"({layout.nodes} node(s) x {layout.procs_per_node})")
    wanted = layout.num_nodes * layout.devices
    if world is not None and world != wanted:
        findings.add("silent", f"{var}={world} but num_nodes {layout.num_nodes} x devices {layout.devices} = "
                               f"{wanted}")

def _check_master(views: list[dict], findings: Findings) -> None:
    for key, label in (("master_addr", "MASTER_ADDR"), ("master_port", "MASTER_PORT")):
        values = {_who(v): v[key] for v in views}
        if len(set(values.values())) > 1:
            listing = ", ".join(f"rank {r}: {val}" for r, val in sorted(values.items()))
            findings.add("deadlock", f"{label} differs across ranks ({listing}); every rank must "
                                     f"rendezvous at the same address")

def _check_node_count(views: list[dict], layout: _Layout, trainer: dict, findings: Findings) -> None:
    """The distinct node ranks the processes report are the Trainer's num_nodes."""
    wanted = trainer.get("num_nodes")
    if not wanted or layout.nodes == wanted:
        return
    node_var = views[0]["node_var"]
    seen = ", ".join(map(str, sorted(layout.per_node, key=str)))
    if layout.nodes < wanted:
        findings.add("deadlock", f"the Trainer has num_nodes={wanted} but the processes report {layout.nodes} "
                                 f"distinct {node_var} value(s) ({seen}); every node needs its own {node_var}")
    else:
        findings.add("silent", f"the launch spans {layout.nodes} nodes ({node_var} {seen}) but the "
                               f"Trainer has num_nodes={wanted}")

def _check_seats(views: list[dict], layout: _Layout, findings: Findings) -> None:
    """Each (node rank, local rank) and global rank once; node ranks 0..nodes-1."""
    seats = [(v["node_rank"], v["local_rank"]) for v in views if v["local_rank"] is not None]
    doubled = sorted({s for s in seats if seats.count(s) > 1}, key=str)
    if doubled:
        findings.add("deadlock", "several processes claim the same (node rank, local rank): "
                                 + ", ".join(f"{n}/{lr}" for n, lr in doubled))
    ranks = sorted(_who(v) for v in views)
    if layout.world is not None and ranks != list(range(len(views))):
        findings.add("deadlock", f"global ranks are {ranks}, not 0..{len(views) - 1} once each")
    node_ranks = sorted(n for n in layout.per_node if n is not None)
    if node_ranks != list(range(layout.nodes)):
        findings.add("deadlock", f"node ranks are {node_ranks}, not 0..{layout.nodes - 1}")

def _check_timeout(views: list[dict], trainer: dict, findings: Findings) -> None:
    """The timeout belongs to the strategy: NCCL_TIMEOUT is read by neither torch nor Lightning."""
    nccl = {_who(v): v["env"]["NCCL_TIMEOUT"] for v in views if "NCCL_TIMEOUT" in v["env"]}
    if not nccl:
        return
    value = next(iter(nccl.values()))
    if trainer.get("timeout_s"):
        findings.note(f"NCCL_TIMEOUT={value} is set but has no effect; the strategy's timeout "
                      f"({trainer['timeout_s']:g} s) is the one in force.")
    else:
        findings.add("silent", f"NCCL_TIMEOUT={value} is set on rank(s) {', '.join(map(str, sorted(nccl)))} "
                               f"while the strategy keeps its default process-group timeout")

def check(views: list[dict], trainer: dict) -> tuple[list[tuple[str, int | None, str]], list[str], dict]:
    """Judge a launch: ``views`` (one per started process, from :func:`view`) against the user's
    Trainer settings ``trainer`` (``num_nodes``, ``devices``: numbers or None, ``timeout_s``).

    Returns (problems as (category, rank or None, detail), notes, layout facts).
    """
    findings, facts = _checked(views, trainer)
    return [(f.category, f.rank, f.detail) for f in findings.items], findings.notes, facts

def _checked(views: list[dict], trainer: dict) -> tuple[Findings, dict]:
    """:func:`check`'s findings in the order found, and the layout facts."""
    findings = Findings()
    layout = _Layout.of(views, trainer)
    _check_node_sizes(layout, trainer, findings)
    _check_world_size(views, layout, findings)
    _check_master(views, findings)
    _check_node_count(views, layout, trainer, findings)
    _check_seats(views, layout, findings)
    for v in views:
        _BY_NAME[v["launcher"]].validate_process(v, findings)
    _BY_NAME[views[0]["launcher"]].validate(views, layout, findings)
    _check_timeout(views, trainer, findings)
    return findings, layout.facts(views[0])

_FIX = {
    "size": "launch exactly num_nodes x devices processes, devices per node (srun --nodes=N "
            "--ntasks-per-node=D, or torchrun --nnodes N --nproc-per-node D on every node), and give the "
            "Trainer the same num_nodes=N and devices=D",
    "rendezvous": "let the launcher set MASTER_ADDR, MASTER_PORT and the node rank, or export the same "
                  "MASTER_ADDR/MASTER_PORT on every node and a distinct NODE_RANK per node",
    "timeout": "set the process-group timeout on the strategy, e.g. DDPStrategy(timeout=timedelta(minutes=30)), "
               "and drop NCCL_TIMEOUT",
}

def _as_run(trainer: dict, resolved: list[dict]) -> dict:
    """The Trainer settings a run of a local world of several nodes used: the layout's num_nodes and
    devices (the user's own are replaced there; see :func:`_production_note`)."""
    first = next((r for r in resolved if "error" not in r), {})
    return {**trainer, "num_nodes": first.get("num_nodes"), "devices": first.get("devices"),
            "devices_raw": repr(first.get("devices"))}


def _check_resolved(views: list[dict], resolved: list[dict], findings: Findings) -> None:
    """Lightning's Trainer, built from the user's kwargs on every rank, reads the launch as the
    launcher made it: the same global, node and local rank and world size (a cluster environment
    plugin, or a variable the module sets, can make it read another world)."""
    for v, seen in zip(views, resolved):
        rank = _who(v)
        if "error" in seen:
            findings.add("deadlock", f"the Trainer cannot be built from your kwargs in this launch: {seen['error']}",
                         rank=rank)
            continue
        env = seen.get("environment")
        for key, launched, label in (("global_rank", v["rank"], "RANK"), ("node_rank", v["node_rank"], v["node_var"]),
                                     ("local_rank", v["local_rank"], "LOCAL_RANK"),
                                     ("world_size", v["world_size"], v["world_var"])):
            if launched is not None and seen.get(key) != launched:
                findings.add("deadlock", f"Lightning's {env} gives trainer.{key}={seen.get(key)} but the launcher set "
                                         f"{label}={launched}", rank=rank)


def _production_note(first: dict, resolved: list[dict] | None) -> list[str]:
    """What the user's own num_nodes and devices make of the production world, when they differ from
    the layout the run used."""
    if resolved is None:
        return []
    user, ran = first.get("trainer") or {}, _as_run({}, resolved)
    if not (user.get("num_nodes") or user.get("devices")):
        return []
    if (user.get("num_nodes"), user.get("devices")) == (ran["num_nodes"], ran["devices"]):
        return []
    nodes, devices = user.get("num_nodes") or 1, user.get("devices") or "auto"
    total = f" ({nodes * devices} ranks)" if isinstance(devices, int) else ""
    return [f"your Trainer kwargs say num_nodes={nodes}, devices={devices}{total}: the launcher of that job must start "
            f"{nodes} node(s) x {devices} process(es); this run used num_nodes={ran['num_nodes']}, devices="
            f"{ran['devices']}."]


class LaunchEnv(Contract):
    id = "launch-env"
    title = "The launched world matches the Trainer's num_nodes x devices, and every rank agrees"
    rule_section = "Multi-node launch"
    run_spec = inspection("launch")
    probe_class = LaunchEnvProbe
    strategies = ("ddp",)
    tiers = ("nodes", "multinode")

    def judge(self, run: Run) -> Verdict:
        observed = [o for o in run.probe(self.id) if o]
        if not observed:
            return self.verdict(Outcome.ERROR, "no rank reported its launch environment.")
        trainer = observed[0]["trainer"]
        launch_site = None
        resolved = None
        if all(o["kind"] == "attached" for o in observed):
            envs, source = [o["env"] for o in observed], "as every rank saw it"
        elif observed[0].get("simulated"):
            envs, source = observed[0]["simulated"], "from the module's recorded LAUNCH_ENV"
            launch_site = fmt_site(observed[0].get("simulated_site")) if observed[0].get("simulated_site") else None
        elif all(o.get("resolved") for o in observed):  # a local world of several nodes on this host
            envs, resolved = [o["env"] for o in observed], [o["resolved"] for o in observed]
            source = f"the plugin's launch of {observed[0]['nodes']} nodes on this host, as torchrun sets it"
            trainer = _as_run(trainer, resolved)
        else:
            return self.verdict(
                Outcome.SKIPPED, "not inside a multi-node world: these ranks were started by pytest-ltconform "
                                 "itself, so there is no torchrun or SLURM launch to check (run pytest under "
                                 "torchrun or srun and select -m ltconform_multinode).")
        views = [view(env, i) for i, env in enumerate(envs)]
        found, layout = _checked(views, trainer)
        if resolved is not None:
            _check_resolved(views, resolved, found)
        where = f"{layout['launcher']} launch of {layout['nodes']} node(s) x {layout['per_node']} process(es)"
        if not found.items:
            summary = (f"the {where} matches the Trainer: {layout['var']}={layout['world']} = num_nodes "
                       f"{layout['num_nodes']} x devices {layout['devices']}, and every rank agrees on the node "
                       f"ranks and on MASTER {layout['master']} ({source}).")
            if resolved is not None:
                env = resolved[0].get("environment")
                summary += (f" On every rank Lightning's {env} reads the launcher's global, node and local rank "
                            f"and the world size.")
            return self.verdict(Outcome.PASSED, summary, notes=found.notes + _production_note(observed[0], resolved))
        evidence = [Evidence(f.detail, rank=f.rank, site=launch_site) for f in found.items]
        trainer_site = observed[0].get("trainer_site")
        if trainer_site and (trainer.get("num_nodes") or trainer.get("devices")):
            evidence.append(Evidence(f"the Trainer kwargs (num_nodes={trainer.get('num_nodes') or 'unset'}, devices="
                                     f"{trainer.get('devices_raw') or 'unset'}, strategy={trainer.get('strategy')}) "
                                     f"come from here", site=fmt_site(trainer_site)))
        kinds = set()
        for detail in (f.detail for f in found.items):
            rendezvous = ("MASTER_", "NODE_RANK", "node ranks", "global ranks", "claim", "interactive")
            kinds.add("timeout" if "NCCL_TIMEOUT" in detail else
                      "rendezvous" if any(w in detail for w in rendezvous) else "size")
        fix = "; ".join(_FIX[k] for k in ("size", "rendezvous", "timeout") if k in kinds) + "."
        summary = f"the {where} disagrees with the Trainer or across ranks ({source}): {found.summary()}."
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=fix, category=found.lead.category,
                            notes=found.notes)

CONTRACT = LaunchEnv()
