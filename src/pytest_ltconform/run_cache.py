"""Where a session keeps the runs it made, so each run (a ``runs.RunKey``: target x kind x
strategy x tier x layout) is made once: in this process (:class:`LocalRuns`), or once across the
pytest-xdist workers of one session (:class:`SharedRuns`), whichever worker's item asks first.

Under xdist the items of one run may land on several workers (``--dist load`` deals them in
chunks; a user's own scheduler may do anything). The first worker to ask for a run makes it under
the run's lock in the session folder (``world.share``) and hands it over pickled: a worker asking
meanwhile waits for it, a later one reads it. The training runs of one target are made one at a
time across the workers (:meth:`SharedRuns.serial`), as a serial session makes them, so a run
that would hang as an earlier one of the target did is not started (``session._hung_before``
sees that run) instead of hanging beside it.
"""

from __future__ import annotations

import contextlib
from typing import Any

from .runs import RunKey
from .world.share import SessionShare, key_name


class LocalRuns(dict):
    """The runs of this process (a session without xdist): a dict of RunKey -> run, with the
    methods :class:`SharedRuns` has."""

    def __init__(self):
        super().__init__()
        self.made_here: list[RunKey] = []  # the runs this process made, in order

    def once(self, key: RunKey, make) -> Any:
        """The run made for ``key`` (a ``contracts.base.Run``, or the ``WorldStartError`` that
        stopped it), made now by ``make()`` when none was."""
        if key not in self:
            self[key] = make()
            self.made_here.append(key)
        return self[key]

    def remake(self, key: RunKey, make) -> Any:
        """The run ``make()`` makes now, made again when one was (fresh-world mode shares nothing)."""
        self[key] = make()
        self.made_here.append(key)
        return self[key]

    def serial(self, key: RunKey):
        """Held while a training run of ``key``'s target is made (one process: nothing to hold)."""
        return contextlib.nullcontext()

    def made(self, target: str) -> list[tuple[RunKey, Any]]:
        """(key, run) of every run of ``target`` made so far, oldest first."""
        return [(k, v) for k, v in self.items() if k.target == target]


class SharedRuns:
    """The runs of every pytest-xdist worker of one session, in its folder (``share``)."""

    def __init__(self, share: SessionShare):
        self.share = share
        self.made_here: list[RunKey] = []

    @staticmethod
    def _name(key: RunKey) -> str:
        return f"run-{key_name(key.target)}-{key_name(key)}"

    def get(self, key: RunKey) -> Any:
        """The run made for ``key`` by any worker (waiting while one is making it); None if none was."""
        found, made = self.share.peek(self._name(key))
        return made[1] if found else None

    def once(self, key: RunKey, make) -> Any:
        """The run made for ``key``: made now by ``make()`` when no worker made it, else the one
        its worker made (waited for while it is being made)."""
        def made_here():
            made = key, make()
            self.made_here.append(key)
            return made

        return self.share.once(self._name(key), made_here)[1]

    def serial(self, key: RunKey):
        """Held while a training run of ``key``'s target in ``key``'s tier is made: one at a time
        across the workers."""
        return self.share.holding(f"train-{key_name(key.target, key.tier)}")

    def made(self, target: str) -> list[tuple[RunKey, Any]]:
        """(key, run) of every run of ``target`` any worker made so far, oldest first."""
        out = []
        for name in self.share.names(f"run-{key_name(target)}-"):
            found, made = self.share.peek(name)
            if found:
                out.append(made)
        return out
