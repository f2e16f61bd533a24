"""The protocol between a world's supervisor and its ranks, spelled once: store keys, file names,
the stop message, the environment a rank is started with, and the shape of a rank's result.

A local world (``local.py``) and its rank processes (``rank.py``) meet in a ``TCPStore`` under
keys of one generation of ranks (``g<gen>/...``); an attached world (``attached.py``) uses the
same job runner and result shape over the launcher's store, under its own prefix. Pure Python,
no torch: both sides import it.
"""

from __future__ import annotations

import os
import pickle
import struct
from typing import Any, TypedDict

# -- local worlds: the supervisor's store, one generation of ranks at a time -------------------------


def ready_key(gen: int, rank: int) -> str:
    """Where a rank says it paid its cold start (its pid) and waits for jobs."""
    return f"g{gen}/ready/{rank}"


def job_key(gen: int, n: int) -> str:
    """Where the supervisor posts job ``n`` of generation ``gen`` (or :data:`STOP`)."""
    return f"g{gen}/job/{n}"


def result_key(gen: int, n: int, rank: int) -> str:
    """Where a rank posts its result of job ``n`` (see :func:`result_payload`)."""
    return f"g{gen}/result/{n}/{rank}"


def group_prefix(gen: int, n: int) -> str:
    """The store prefix of job ``n``'s default process group."""
    return f"g{gen}/pg/{n}"


def formed_keys(gen: int, n: int, world_size: int) -> list[str]:
    """The store keys where each rank says whether it formed job ``n``'s process group."""
    return [f"g{gen}/formed/{n}/{r}" for r in range(world_size)]


# What a rank posts under its formed key once it has the job's group (else its error, as text).
FORMED = b"formed"

# The supervisor's "stop" message, posted as the next job: an idle rank exits at once.
STOP = pickle.dumps(None)

# -- attached worlds: the launcher's store, under PREFIX --------------------------------------------

PREFIX = "ltconform/"


def attached_result_key(n: int, rank: int) -> str:
    return f"result/{n}/{rank}"


def final_key(n: int) -> str:
    """Where rank 0 of an attached world publishes job ``n``'s assembled result."""
    return f"final/{n}"


def left_key(rank: int) -> str:
    """Where a rank of an attached world says it has finished with the store."""
    return f"left/{rank}"


# -- files: a world's folder and a job's folder -----------------------------------------------------


def trace_file(job_dir: str, rank: int) -> str:
    """The JSON-lines trace rank ``rank`` records in a job's folder."""
    return os.path.join(job_dir, f"rank{rank}.trace.jsonl")


def rank_dir(job_dir: str, rank: int) -> str:
    """Rank ``rank``'s own folder inside a job's folder."""
    return os.path.join(job_dir, f"rank{rank}")


def log_file(root: str, gen: int, rank: int) -> str:
    """A local rank process's stdout and stderr, in its world's folder."""
    return os.path.join(root, f"g{gen}-rank{rank}.log")


def stack_file(root: str, gen: int, rank: int) -> str:
    """Where a local rank's faulthandler writes its stack (a crash, or SIGUSR1 from the supervisor)."""
    return os.path.join(root, f"g{gen}-rank{rank}.stack")


# -- the environment of a rank process --------------------------------------------------------------

GENERATION_ENV = "LTCONFORM_GENERATION"
WORLD_DIR_ENV = "LTCONFORM_WORLD_DIR"
SUPERVISOR_PID_ENV = "LTCONFORM_SUPERVISOR_PID"
# The process a rank dies with: the supervisor for a spawned rank, the fork parent for a forked one.
PARENT_PID_ENV = "LTCONFORM_PARENT_PID"
PRELOAD_ENV = "LTCONFORM_PRELOAD"

# -- the nodes of a local world of several nodes on this host (``nodes.py``) ------------------------
# How the supervisor asks a node's storage to be kept apart: 'mountns' (a private mount namespace per
# node with its own tmpfs at one path, the default) or 'tmpdir' (a folder per node; also what a rank
# falls back to where the kernel refuses namespaces). Set in pytest's environment, it chooses.
NODE_ISOLATION_ENV = "LTCONFORM_NODE_ISOLATION"
NODE_ISOLATIONS = ("mountns", "tmpdir")
# The path every node mounts its own tmpfs at (the same on every node, as /tmp is on a cluster).
NODE_MOUNT_ENV = "LTCONFORM_NODE_MOUNT"
# This node's own folder on the shared disk (the 'tmpdir' storage).
NODE_DIR_ENV = "LTCONFORM_NODE_DIR"
# Where local rank 0 of a node says which namespace its node's ranks join (its pid), or why none.
NODE_NS_ENV = "LTCONFORM_NODE_NS"
# Set by the rank once it entered its node: the node-local root in force, and how it is kept apart.
NODE_ROOT_ENV = "LTCONFORM_NODE_ROOT"
NODE_STORAGE_ENV = "LTCONFORM_NODE_STORAGE"
# The variables a launcher or a cluster points at node-local scratch space; a rank of a node world gets
# its node's folder (a fresh one per job) in each.
NODE_TMP_VARS = ("TMPDIR", "SLURM_TMPDIR")


def node_mount(root: str) -> str:
    """The mount point of every node's tmpfs in the world folder ``root``."""
    return os.path.join(root, "node-local")


def node_dir(root: str, node: int) -> str:
    """Node ``node``'s own folder in the world folder ``root`` (its 'tmpdir' storage)."""
    return os.path.join(root, f"node{node}")


def node_ns_file(root: str, gen: int, node: int) -> str:
    """Where local rank 0 of node ``node`` of generation ``gen`` publishes its namespace."""
    return os.path.join(root, f"g{gen}-node{node}.ns")


# Inherited variables that would make Lightning think it runs under a cluster launcher.
FOREIGN_ENV_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "GROUP_", "ROLE_", "LSB_",
                        "JSM_", "KUBEFLOW_")
FOREIGN_ENV = ("LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "NODE_RANK", "GROUP_WORLD_SIZE")


def without_launcher_env(environ: dict) -> dict:
    """``environ`` less what a cluster launcher set (see :data:`FOREIGN_ENV_PREFIXES`)."""
    return {k: v for k, v in environ.items() if not k.startswith(FOREIGN_ENV_PREFIXES) and k not in FOREIGN_ENV}


# -- a rank's result of one job ---------------------------------------------------------------------

# The stage of a job before the user's code runs: its process group is being formed.
FORMATION = "formation"


class RankResult(TypedDict, total=False):
    """What a rank posts for one job (``rank.run_job`` makes it, ``RankOutcome.from_wire`` reads
    it): ``status`` 'ok', 'error' or 'skip'; ``value`` what the job function returned;
    ``exc_type``, ``message``, ``traceback`` when it raised; ``stage`` :data:`FORMATION` when that
    was before the job's code ran; ``trace`` the rank's events, sent along by attached ranks only."""

    rank: int
    status: str
    value: Any
    exc_type: str
    message: str
    traceback: str
    stage: str
    duration_s: float
    trace: list


def result_payload(result: RankResult) -> bytes:
    """``result`` pickled for the store; a value that cannot be pickled becomes an error."""
    try:
        return pickle.dumps(result)
    except Exception as exc:
        return pickle.dumps({"rank": result["rank"], "status": "error", "exc_type": "PicklingError",
                             "message": f"the job's result could not be pickled: {exc}", "traceback": "",
                             "trace": result.get("trace") or []})


def read_result(raw: bytes) -> RankResult:
    """The result a rank posted with :func:`result_payload`."""
    return pickle.loads(raw)


# -- messages between the supervisor, the fork parent and a store's keeper (pipes and sockets) ---

_HEADER = struct.Struct("!I")


def send(fd: int, message: tuple) -> None:
    """Write one message (a pickled tuple, length-prefixed) to the pipe or socket ``fd``, blocking
    until it is all written."""
    data = pickle.dumps(message)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def take(buffer: bytearray) -> list[tuple]:
    """The whole messages at the start of ``buffer``, removed from it."""
    out = []
    while len(buffer) >= _HEADER.size:
        (size,) = _HEADER.unpack_from(buffer)
        if len(buffer) < _HEADER.size + size:
            break
        out.append(pickle.loads(bytes(buffer[_HEADER.size:_HEADER.size + size])))
        del buffer[:_HEADER.size + size]
    return out
