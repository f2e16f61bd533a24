"""How a local world's rank processes come to be: forked from a parent that imported torch and
Lightning once (``fork.py``, the default), or each a fresh interpreter (``spawn.py``, the
baseline); the ranks of an attached world were started by torchrun or SLURM (``attached.py``).

Every launcher is a :class:`~.base.Launcher`: ``start(env, log_path, cwd)`` returns a handle with
``pid``, ``poll()``, ``returncode`` and ``wait(timeout)``, as ``subprocess.Popen`` has; the rank
leads its own process group (the supervisor kills it with ``os.killpg``) and writes stdout and
stderr to ``log_path``. :func:`launcher_for` is the one place a kind's name picks its class.
"""

from __future__ import annotations

from ...vocabulary import LAUNCHERS
from .base import Launcher
from .fork import ForkLauncher
from .spawn import SpawnLauncher

DEFAULT_LAUNCHER = LAUNCHERS[0]


def launcher_for(kind: str, preload: tuple[str, ...], start_timeout_s: float = 300.0, share=None,
                 name: str = "") -> Launcher:
    """A new launcher of ``kind`` (one of :data:`~pytest_ltconform.vocabulary.LAUNCHERS`: the
    kinds a user can choose); ValueError names a bad one. Under the fork launcher, ``share`` (a
    ``world.share.SessionShare``) makes its parent the one called ``name`` that the session's
    pytest-xdist workers share."""
    if kind == "fork":
        return ForkLauncher(preload, start_timeout_s, share=share, name=name)
    if kind == "spawn":
        return SpawnLauncher()
    raise ValueError(f"unknown rank launcher {kind!r}; choose from {', '.join(LAUNCHERS)}")
