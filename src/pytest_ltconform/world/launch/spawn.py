"""The spawn launcher: every rank a fresh ``python -m pytest_ltconform.world.rank`` (each pays the
imports; the baseline the fork launcher is measured against)."""

from __future__ import annotations

import subprocess
import sys

from .base import Launcher


class SpawnLauncher(Launcher):
    """Every rank a fresh interpreter, leading its own process group. It has no parent to serve a
    store, fork fresh processes or import ahead of the ranks: those answer None."""

    kind = "spawn"

    def __init__(self):
        self.imports = 0  # interpreters started that import the preload modules

    def start(self, env: dict, log_path: str, cwd: str) -> subprocess.Popen:
        self.imports += 1
        with open(log_path, "wb") as log:
            return subprocess.Popen([sys.executable, "-m", "pytest_ltconform.world.rank"], env=env,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                    start_new_session=True)

    def close(self) -> None:
        pass
