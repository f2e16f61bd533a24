"""What every launcher answers: how the ranks of a world come to be, and where their store is.

A :class:`Launcher` is chosen once per world (``launch.launcher_for``, or the attached world's
own) and asked the same questions whatever its kind, as Lightning asks each ``ClusterEnvironment``
the same questions: start a rank, serve the world's store, run a fresh process, import modules
ahead of the ranks. A capability a launcher lacks answers None (the world then does it itself, or
goes without), never an ``AttributeError`` to probe for.
"""

from __future__ import annotations

from typing import Any, Protocol


class LaunchError(RuntimeError):
    """No rank could be started: the fork parent died while importing, or refused to fork; or the
    launcher starts no rank (an attached world's are started by torchrun or SLURM)."""


class RankProcess(Protocol):
    """A started rank, as ``subprocess.Popen`` has it: ``pid`` (it leads its own process group),
    ``returncode`` (None while it runs), ``poll()``, ``wait(timeout)`` (raises
    ``subprocess.TimeoutExpired``) and ``kill()``."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


class Launcher(Protocol):
    """How a world's ranks start (``kind``: 'fork', 'spawn' or 'attached'). ``imports`` counts the
    processes that imported the preload modules (fork parents, or every spawned rank).

    Implementations (one per module): ``fork.ForkLauncher``, ``spawn.SpawnLauncher``,
    ``attached.AttachedLauncher``. They subclass this class, so the optional capabilities below
    answer None unless a launcher has them.
    """

    kind: str = ""
    imports: int = 0

    def start(self, env: dict, log_path: str, cwd: str) -> RankProcess:
        """Start one rank with the environment ``env`` in ``cwd``, its stdout and stderr going to
        ``log_path``. Raises :class:`LaunchError` when no rank can be started."""
        raise NotImplementedError

    def store(self, env: dict, folder: str) -> Any | None:
        """The world's store, served by the launcher (the fork parent's keeper, or the launched
        world's rendezvous store), given a rank's environment ``env`` and the world folder; None
        when the world holds its own (``torch.distributed.TCPStore`` on port 0). Raises
        :class:`LaunchError` when the launcher cannot serve it."""
        return None

    def fresh(self, entry: str, args: list, *, env: dict, cwd: str, folder: str, timeout_s: float,
              parent_env: dict) -> dict | None:
        """Call ``entry`` with ``args`` in a fresh process forked from the launcher's parent (see
        ``zygote.run_fresh``); None when the launcher has no such parent."""
        return None

    def import_now(self, names: list[str], parent_env: dict, folder: str) -> dict[str, str | None] | None:
        """Have the launcher's parent import ``names`` now: ``{name: why its import failed, or
        None}``; None when the launcher has no such parent."""
        return None

    def close(self) -> None:
        """Stop what the launcher runs of its own (the fork parent, and the ranks it forked)."""
