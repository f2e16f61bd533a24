"""A job: what a world runs on every rank, and how it travels to them. Pure data, no torch."""

from __future__ import annotations

import dataclasses
import importlib
import pickle
from collections.abc import Callable
from typing import Any


def resolve(ref: str) -> Any:
    """The object a "module:qualname" reference names (a job's ``fn``, a probe class): the one
    place such references are resolved, on the ranks and in the harness."""
    module_name, _, qualname = ref.partition(":")
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@dataclasses.dataclass
class JobRequest:
    """What a caller asks a world to run (see ``World.run``): ``fn(ctx, *args, **kwargs)`` on every
    rank, ``fn`` an importable ``"pkg.mod:func"``, stopped after ``timeout_s`` seconds.

    A world killed at that limit names it as ``timeout_name=<value>`` (None: the world's own
    name for it); ``progress``, when given, is called while ranks still run (see
    ``LocalWorld.run``; a launched world does not call it).

    ``tenant`` names whose process state the job runs in (the session passes its target and
    strategy): a local world replaces ranks that last ran another tenant's job before this one,
    so no target sees what an earlier one left in a rank process (thread pools, patched modules,
    library flags). None is a tenant too (the fixtures' jobs share their ranks). A launched world
    cannot replace its ranks and ignores it."""

    fn: str
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    timeout_s: float = 120.0
    timeout_name: str | None = None
    progress: Callable[[float, dict], None] | None = None
    seed: int = 0
    tenant: str | None = None
    # "same": every rank seeded with ``seed``; "per-rank": rank r with ``seed + r``; "both": ``seed + r``
    # (the job's code reseeds every rank alike where it says so: the traced fit, when training starts).
    seeding: str = "same"


@dataclasses.dataclass
class Job:
    """One job: run ``fn(ctx, *args, **kwargs)`` on every rank of a world.

    ``fn`` is an importable ``"pkg.mod:func"``; ``dir`` the job's folder (rank r works in
    ``dir/rank<r>`` and records ``dir/rank<r>.trace.jsonl``); ``n`` the job's index in its
    generation of ranks (it names the process group's store prefix); ``pg_timeout_s`` the
    collective timeout in seconds; ``accelerator`` None means 'gpu' under NCCL, else 'cpu'.
    """

    fn: str
    dir: str
    n: int
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    seed: int = 0
    seeding: str = "same"
    backend: str = "gloo"
    pg_timeout_s: float = 30.0
    accelerator: str | None = None
    num_nodes: int = 1
    world_kind: str = "local"

    def wire(self) -> bytes:
        """What travels to the ranks through the store: the fields as a pickled dict (shallow,
        so the arguments keep their own types); :meth:`from_wire` rebuilds the job."""
        return pickle.dumps({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @classmethod
    def from_wire(cls, raw: bytes) -> Job | None:
        """The job :meth:`wire` sent, or None for the supervisor's "stop" message (``protocol.STOP``)."""
        fields = pickle.loads(raw)
        return None if fields is None else cls(**fields)
