"""Live progress of long contract runs: a line once a run has taken a while, then one as often,
written through pytest's terminal reporter (also while pytest captures an item's setup)."""

from __future__ import annotations

import contextlib
import os

import pytest

LIVE_OPEN_KEY = pytest.StashKey[bool]()  # a live progress line was written and not yet ended

# Live progress of a long contract run: a first line once it has run this long, then one line
# this often (seconds); LTCONFORM_PROGRESS_S overrides it, 0 turns the lines off.
PROGRESS_ENV = "LTCONFORM_PROGRESS_S"
PROGRESS_EVERY_S = 10.0


def progress_every_s() -> float:
    raw = os.environ.get(PROGRESS_ENV, "")
    try:
        return float(raw) if raw.strip() else PROGRESS_EVERY_S
    except ValueError:
        return PROGRESS_EVERY_S


def progress_lines(config: pytest.Config, target_id: str | None = None):
    """``for_run(label)`` -> the progress callback of one run (see LocalWorld.run), which writes a
    live line once the run has taken ``LTCONFORM_PROGRESS_S`` (default 10 s) and then as often; None
    where nothing may be printed: 0 seconds, ``-qq``, an xdist worker, a quiet rank of a launched
    world (its terminal reporter is gone). The label names ``target_id`` when one is given (the
    session checks several targets)."""
    every = progress_every_s()
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if every <= 0 or reporter is None or config.get_verbosity() <= -2 or hasattr(config, "workerinput"):
        return None

    named = f"{target_id}::" if target_id is not None else ""

    def for_run(label: str):
        due = [every]

        def progress(elapsed_s: float, idle_s: dict) -> None:
            if elapsed_s < due[0]:
                return
            due[0] = (elapsed_s // every + 1) * every
            write_live(config, reporter, progress_line(named + label, elapsed_s, idle_s, stalled_after_s=every))

        return progress

    return for_run


def progress_line(label: str, elapsed_s: float, idle_s: dict, stalled_after_s: float) -> str:
    """``ltconform: fit[ddp] running, 30 s``, plus the ranks whose trace has not grown for
    ``stalled_after_s`` seconds or more (``idle_s``: {rank: seconds})."""
    line = f"ltconform: {label} running, {elapsed_s:.0f} s"
    stalled = [f"rank {r} (no progress for {s:.0f} s)" for r, s in sorted(idle_s.items()) if s >= stalled_after_s]
    return line + (f"; waiting for {', '.join(stalled)}" if stalled else "")


def write_live(config: pytest.Config, reporter, line: str) -> None:
    """Write ``line`` now on a line of its own, also while pytest captures output (item setup): with
    its global capture suspended, and flushed before capture resumes. The line is left open;
    ``end_live_line`` ends it before pytest writes the item's outcome, so that outcome keeps its
    prefix instead of standing alone on a line."""
    capman = config.pluginmanager.get_plugin("capturemanager")
    with capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext():
        reporter.ensure_newline()
        if config.get_terminal_writer().width_of_current_line:  # -q's dots, or our previous line
            reporter.write("\n")
        reporter.write(line)
        reporter.flush()
    config.stash[LIVE_OPEN_KEY] = True


def end_live_line(config: pytest.Config, nodeid: str | None = None) -> None:
    """After a live line, pytest's next output starts a line of its own: under the default
    verbosity with the item's file prefix (``ltconform ``) before its outcome letter; under -v
    pytest writes the item's id again itself."""
    if not config.stash.get(LIVE_OPEN_KEY, False):
        return
    config.stash[LIVE_OPEN_KEY] = False
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    if nodeid is not None and config.get_verbosity() == 0 and reporter.showfspath:
        reporter.write_fspath_result(nodeid, "")
    elif nodeid is None or config.get_verbosity() < 0:
        reporter.write("\n")
