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


def rank_pids(supervisor_pid: int | None = None, cwd_marker: str | None = None) -> list[int]:
    """Live rank processes, optionally only those of one supervisor, or of supervisors started in a
    directory under ``cwd_marker`` (a rank's PYTHONPATH carries its supervisor's working directory)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = dict(item.split(b"=", 1) for item in fh.read().split(b"\0") if b"=" in item)
            with open(f"/proc/{entry}/stat", "rb") as fh:
                state = fh.read().split(b")")[-1].split()[0]
        except OSError:
            continue
        if state == b"Z" or b"LTCONFORM_SUPERVISOR_PID" not in env:
            continue
        if supervisor_pid is not None and int(env[b"LTCONFORM_SUPERVISOR_PID"]) != supervisor_pid:
            continue
        if cwd_marker is not None and cwd_marker.encode() not in env.get(b"PYTHONPATH", b""):
            continue
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
def no_leftover_ranks(pytester):
    """Fails the test if rank processes its pytest subprocesses started are still alive afterwards."""
    yield
    marker = str(pytester.path)
    assert wait_until(lambda: not rank_pids(cwd_marker=marker), 15), \
        f"rank processes left behind: {rank_pids(cwd_marker=marker)}"
