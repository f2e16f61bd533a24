"""Worlds: starting, reusing, supervising and diagnosing rank processes.

``LocalWorld`` starts ranks on this host; ``pool()`` hands out one persistent world per
(world size, backend, collective timeout) for the whole pytest session.
"""

from __future__ import annotations

import atexit
import os
import shutil

from .local import LocalWorld, WorldStartError, remove_stale_worlds
from .outcome import JobResult, RankOutcome

__all__ = ["JobResult", "LocalWorld", "RankOutcome", "WorldStartError", "WorldPool", "remove_stale_worlds"]


class WorldPool:
    """Persistent worlds keyed by (world size, backend, collective timeout, rank environment).

    ``timeout_name`` is what a job killed at its time limit names (the caller's option, e.g.
    ``--ltconform-timeout``) unless the run names its own. Creating a pool removes the world
    folders that killed sessions left behind (see :func:`remove_stale_worlds`).
    """

    def __init__(self, fresh_per_job: bool | None = None, timeout_name: str = "timeout_s"):
        remove_stale_worlds()
        self.timeout_name = timeout_name
        self._worlds: dict[tuple, LocalWorld] = {}
        if fresh_per_job is None:
            # LTCONFORM_FRESH_WORLDS=1: a cold world per job, for measuring what reuse saves.
            fresh_per_job = os.environ.get("LTCONFORM_FRESH_WORLDS", "") not in ("", "0")
        self.fresh_per_job = fresh_per_job
        self._kept: list[str] = []
        atexit.register(self.close)

    def get(self, world_size: int, backend: str = "gloo", pg_timeout_s: float = 30.0,
            env: dict | None = None) -> LocalWorld:
        """The world for these parameters; ``env`` ({name: value}) is set in each rank's environment."""
        key = (world_size, backend, pg_timeout_s, tuple(sorted((env or {}).items())))
        world = self._worlds.get(key)
        if world is None or world.closed:
            world = self._worlds[key] = LocalWorld(world_size, backend=backend, pg_timeout_s=pg_timeout_s, env=env,
                                                   timeout_name=self.timeout_name)
        return world

    def run(self, world_size: int, fn_ref: str, *args, timeout_s: float, backend: str = "gloo",
            pg_timeout_s: float = 30.0, env: dict | None = None, timeout_name: str | None = None,
            progress=None, **kwargs) -> JobResult:
        """Run ``fn_ref`` on every rank of the pool's world of ``world_size`` (see
        :meth:`LocalWorld.run`, also for ``progress``); ``env`` is set in each rank's environment;
        ``kwargs`` go to the function."""
        world = self.get(world_size, backend, pg_timeout_s, env)
        try:
            return world.run(fn_ref, *args, timeout_s=timeout_s, kwargs=kwargs, timeout_name=timeout_name,
                             progress=progress)
        finally:
            if self.fresh_per_job:
                world.close(keep_files=True)
                self._kept.append(world.root)

    @property
    def cold_starts(self) -> int:
        return sum(w.cold_starts for w in self._worlds.values())

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()
        for root in self._kept:
            shutil.rmtree(root, ignore_errors=True)
        self._kept.clear()
