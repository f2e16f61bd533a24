"""Worlds: starting, reusing, supervising and diagnosing rank processes.

Every world is a :class:`World`: ``LocalWorld`` starts ranks on this host, ``AttachedWorld`` is
the torchrun or SLURM world pytest itself runs in. How ranks come to be is a ``launch.base.Launcher``
(fork, spawn, attached). ``WorldPool`` hands out one persistent local world per (layout, backend,
collective timeout, rank environment) for the whole session.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from typing import Protocol

from ..vocabulary import DEEPSPEED_PRELOAD
from . import launch
from .job import JobRequest
from .launch import DEFAULT_LAUNCHER, LAUNCHERS
from .launch.base import Launcher
from .layout import Layout
from .local import LocalWorld, WorldStartError, remove_stale_worlds
from .outcome import JobResult, RankOutcome
from .share import SessionShare, key_name

__all__ = ["LAUNCHERS", "JobRequest", "JobResult", "Layout", "LocalWorld", "RankOutcome", "SessionShare", "World",
           "WorldPool", "WorldStartError", "remove_stale_worlds"]


def session_folder() -> str:
    """A new folder for the pytest-xdist workers of one session to share (``share.SessionShare``),
    owned by this process: removed by a later session if this one is killed before it removes it
    (see :func:`remove_stale_worlds`)."""
    from .local import WORLD_PREFIX, write_owner
    from .share import make_folder

    path = make_folder(WORLD_PREFIX + "xdist-")
    write_owner(path)
    return path


class World(Protocol):
    """Ranks that run jobs: ``run(request)`` runs ``request.fn`` on every rank and returns the
    :class:`JobResult` (never raising for what a rank did; :class:`WorldStartError` when no rank
    could run it); ``close()`` stops the ranks it owns. ``accelerator`` is 'cpu' or 'gpu'."""

    world_size: int

    @property
    def accelerator(self) -> str: ...

    def run(self, request: JobRequest) -> JobResult: ...

    def close(self) -> None: ...


class WorldPool:
    """Persistent worlds keyed by (layout, backend, collective timeout, rank environment).

    ``timeout_name`` is what a job killed at its time limit names (the caller's option, e.g.
    ``--ltconform-timeout``) unless the run names its own. Creating a pool removes the world
    folders that killed sessions left behind (see :func:`remove_stale_worlds`).

    ``share`` (a ``share.SessionShare``: the workers of a pytest-xdist session) makes the pool's
    fork parents the session's shared ones, and with ``slots`` (a count) its worlds run a job only
    while they hold one of that many world slots of the session: at most ``slots`` worlds run at
    once on this machine, whichever worker started them (None: no bound).
    """

    def __init__(self, fresh_per_job: bool | None = None, timeout_name: str = "timeout_s",
                 launcher: str = DEFAULT_LAUNCHER, preload: tuple[str, ...] = ("lightning.pytorch",),
                 share: SessionShare | None = None, slots: int | None = None):
        remove_stale_worlds()
        if launcher not in LAUNCHERS:
            raise ValueError(f"unknown rank launcher {launcher!r}; choose from {', '.join(LAUNCHERS)}")
        self.timeout_name = timeout_name
        self.launcher = launcher
        self.preload = preload
        self.share, self.slots = share, slots
        self._worlds: dict[tuple, LocalWorld] = {}
        # One fork parent per rank environment (DeepSpeed reads its accelerator when imported),
        # shared by the worlds of every size: each parent is one import for the session.
        self._launchers: dict[tuple, Launcher] = {}
        if fresh_per_job is None:
            # LTCONFORM_FRESH_WORLDS=1: a cold world per job, for measuring what reuse saves.
            fresh_per_job = os.environ.get("LTCONFORM_FRESH_WORLDS", "") not in ("", "0")
        self.fresh_per_job = fresh_per_job
        atexit.register(self.close)

    def get(self, layout: Layout | int, backend: str = "gloo", pg_timeout_s: float = 30.0,
            env: dict | None = None) -> LocalWorld:
        """The world for these parameters: ``layout`` (a world size means that many ranks on one
        node); ``env`` ({name: value}) is set in each rank's environment."""
        layout = layout if isinstance(layout, Layout) else Layout.single_node(layout)
        env_key = tuple(sorted((env or {}).items()))
        key = (layout, backend, pg_timeout_s, env_key)
        world = self._worlds.get(key)
        if world is None or world.closed:
            world = self._worlds[key] = LocalWorld(layout=layout, backend=backend, pg_timeout_s=pg_timeout_s, env=env,
                                                   timeout_name=self.timeout_name, fresh_per_job=self.fresh_per_job,
                                                   preload=self._preload(backend),
                                                   launcher=self._launcher(env_key, backend), gate=self._gate)
        return world

    def _gate(self):
        """What a world holds while it runs a job: one of the session's world slots, or nothing."""
        if self.share is None or self.slots is None:
            return contextlib.nullcontext()
        return self.share.slot(self.slots)

    def _preload(self, backend: str) -> tuple[str, ...]:
        # DeepSpeed picks its CUDA accelerator when imported, which may initialise CUDA: the ranks of
        # a CUDA world import it themselves, after the fork.
        return tuple(m for m in self.preload if backend != "nccl" or m not in DEEPSPEED_PRELOAD)

    def _launcher(self, env_key: tuple, backend: str) -> Launcher:
        launcher = self._launchers.get((env_key, backend))
        if launcher is None:
            preload = self._preload(backend)
            # Workers share a parent only with the same imports and import-time environment.
            launcher = self._launchers[env_key, backend] = launch.launcher_for(
                self.launcher, preload, share=self.share, name=key_name(preload, env_key, backend))
        return launcher

    @property
    def cold_starts(self) -> int:
        return sum(w.cold_starts for w in self._worlds.values())

    @property
    def imports(self) -> int:
        """Processes that imported the preload modules: fork parents, or every spawned rank."""
        return sum(launcher.imports for launcher in self._launchers.values())

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()
        for launcher in self._launchers.values():
            launcher.close()
        self._launchers.clear()
