"""Shared paths and helpers for the plugin's own tests."""

from __future__ import annotations

import os
import pathlib
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFORMANCE = REPO / "conformance"
BORING = "lightning.pytorch.demos.boring_classes.BoringModel"


def case(path: str) -> str:
    """Absolute ``file.py:Model`` target of a corpus case."""
    return f"{CONFORMANCE / path}:Model"


def rank_pids(supervisor_pid: int | None = None) -> list[int]:
    """Live rank processes (optionally of one supervisor), found through their environment."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as fh:
                state = fh.read().split(b")")[-1].split()[0]
        except OSError:
            continue
        if state == b"Z":
            continue
        for item in env:
            if item.startswith(b"LTCONFORM_SUPERVISOR_PID="):
                if supervisor_pid is None or int(item.split(b"=", 1)[1]) == supervisor_pid:
                    found.append(int(entry))
    return found


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.fixture
def no_leftover_ranks():
    """Fails the test if rank processes started during it are still alive afterwards."""
    before = set(rank_pids())
    yield
    assert wait_until(lambda: not (set(rank_pids()) - before), 15), \
        f"rank processes left behind: {sorted(set(rank_pids()) - before)}"
