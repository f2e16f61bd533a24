"""The attached launcher: the ranks of a world that torchrun or SLURM started, this pytest
process being one of them. It starts no rank; the world's store is the launcher's rendezvous
store (torchrun's agent store, or one rank 0 serves on the launcher's ``MASTER_PORT`` under
SLURM), under the plugin's own prefix."""

from __future__ import annotations

import datetime
from typing import Any

from .. import protocol
from .base import Launcher, LaunchError


class AttachedLauncher(Launcher):
    """The outside launcher of the world described by ``info`` (``tiers``' ``Attached``: rank,
    world size, main address and port, whether torchrun's agent serves the store)."""

    kind = "attached"

    def __init__(self, info: Any, connect_timeout_s: float = 300.0):
        self.info = info
        self.connect_timeout_s = connect_timeout_s
        self.imports = 0  # every rank is a pytest process: none imports for the plugin's sake

    def start(self, env: dict, log_path: str, cwd: str):
        raise LaunchError(f"{self.info.describe()}: its ranks are started by {self.info.launcher}; the plugin "
                          f"starts none")

    def store(self, env: dict | None = None, folder: str | None = None) -> Any:
        """The rendezvous store, connected now (rank 0 serves it unless torchrun's agent does),
        under :data:`~..protocol.PREFIX`. Raises :class:`LaunchError` naming the address and the fix."""
        import torch.distributed as dist

        info = self.info
        serve = info.rank == 0 and not info.agent_store
        try:
            base = dist.TCPStore(info.main_address, int(info.main_port), is_master=serve, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=self.connect_timeout_s))
        except Exception as exc:
            role = "serve" if serve else "reach"
            raise LaunchError(
                f"{info.describe()}: could not {role} the rendezvous store at {info.main_address}:{info.main_port} "
                f"({type(exc).__name__}: {exc}). Check that MASTER_ADDR names a host every node can reach and "
                f"that the port is free on it.") from None
        return dist.PrefixStore(protocol.PREFIX, base)
