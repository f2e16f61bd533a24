"""Rank side: the production trace runs in a process of its own, forked from rank 0 for it alone.

Building a module under fake tensors can fail half-way and leave torch's dispatch state broken (a
TorchMetrics state set to a real storage under a fake mode did): the next job of that rank then
died with SIGSEGV. So rank 0 forks a child that traces, writes its figures as JSON to a pipe and
exits; it serves no later job, sees no process group (the rank's is hidden in it), runs torch on
one thread, and writes neither to the rank's log nor to its trace. Its own bound is the trace's
operator count (``predict.OP_BUDGET``); a hang is stopped by a wall-clock kill inside the
supervisor's straggler window. A crash or kill of the child is a reason in words, never the user's
failure, and the rank goes on unharmed.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import json
import os
import re
import resource
import select
import signal
import sys
import time
from collections.abc import Callable

from ...sites import fmt_site, is_user_file

MIN_KILL_S = 1.0
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def traced_apart(trace: Callable[[], dict], log_path: str, kill_after_s: float) -> dict:
    """``trace()``'s dict, computed in a forked child; ``{"error": reason}`` when the child raised
    (its reason), crashed twice (the signal and its last user frame) or ran past ``kill_after_s``
    (seconds, both tries together). A child killed by a signal is forked once more while time is
    left: a crash of the fork must not decide which figures judge the item."""
    limit = max(kill_after_s, MIN_KILL_S)
    start = time.monotonic()
    got, crashed = _traced_once(trace, log_path, limit)
    left = limit - (time.monotonic() - start)
    if not crashed or left < MIN_KILL_S:
        return got
    again, crashed = _traced_once(trace, log_path, left)
    return {"error": f"{again['error']}, twice"} if crashed else again


def _traced_once(trace: Callable[[], dict], log_path: str, limit: float) -> tuple[dict, bool]:
    """(the figures or ``{"error": reason}``, whether the child died of a signal)."""
    read_end, write_end = os.pipe()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_end)
        _child(trace, write_end, log_path)
    # The child must end before the supervisor's straggler rule (the process group's timeout + 10 s
    # after the peers finished) takes rank 0 for hung: SIGABRT at the limit, SIGKILL 3 s later.
    os.close(write_end)
    try:
        data, finished = _read(read_end, limit)
    finally:
        os.close(read_end)
    code = _reap(pid, stop=not finished)
    if not finished:
        return {"error": f"the trace did not end within {limit:.0f} s while under its operator budget (it "
                         f"waited on something, or the module is too large to trace within the ranks' "
                         f"process-group timeout, a quarter of --ltconform-timeout), so it was stopped"
                         f"{_where(log_path)}"}, False
    try:
        return json.loads(data.decode("utf-8")), False
    except ValueError:
        return ({"error": f"the process tracing it {_exit_words(code)} before it gave its figures{_where(log_path)}"},
                code < 0)


def _child(trace: Callable[[], dict], write_end: int, log_path: str) -> None:
    code = 0
    # The rank's objects are never collected here: a cycle holding a process group's work or a
    # gloo buffer would run its destructor against threads this process does not have.
    gc.freeze()
    try:
        log = open(log_path, "w")  # noqa: SIM115 (open until os._exit)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        with contextlib.suppress(Exception):
            faulthandler.unregister(signal.SIGUSR1)  # the rank's stack dump is the rank's
        with contextlib.suppress(Exception):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash leaves no core file in the run's folder
        # A crash, or the parent's SIGABRT of a hang, leaves the Python stack in this log.
        faulthandler.enable(file=log, all_threads=False)
        _one_thread()
        _no_process_group()
        try:
            payload = trace()
        except BaseException as exc:  # what a trace raises is a reason; never the rank's problem
            payload = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
        data = json.dumps(payload).encode("utf-8")
        view = memoryview(data)
        while view:
            view = view[os.write(write_end, view):]
    except BaseException:
        code = 1
    finally:
        os._exit(code)  # no atexit handlers, no destructors of the rank's objects


def _one_thread() -> None:
    """Torch's intra-op pool (OpenMP) is not usable after a fork: a parallel region could wait on
    threads the child does not have. One thread runs every op inline, as DataLoader workers do."""
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(Exception):
            torch.set_num_threads(1)


def _no_process_group() -> None:
    """The rank's process group is hidden (not destroyed: its sockets are the rank's): a collective
    the traced step reaches (a TorchMetrics sync, the user's all_reduce) then sees no group, instead
    of sending on the rank's connections to peers that are not in it."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.distributed_c10d._world.default_pg = None


def _reap(pid: int, stop: bool) -> int:
    """The child's exit code; a child that is to ``stop`` gets SIGABRT first (its handler writes
    the stack to the log), then SIGKILL when it has not died within a few seconds."""
    if stop:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
        for _ in range(30):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _read(fd: int, limit_s: float) -> tuple[bytes, bool]:
    """Everything written to ``fd`` until its writer closed it, and whether it did within ``limit_s``."""
    chunks, deadline = [], time.monotonic() + limit_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), False
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks), True
            chunks.append(chunk)


def _exit_words(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _where(log_path: str) -> str:
    """' (last in user code at path:line (func))' from the child's faulthandler dump; '' without one."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()[-400:]
    except OSError:
        return ""
    for line in lines:  # faulthandler prints the innermost frame first
        m = _FRAME.match(line)
        if m and is_user_file(m["file"]):
            return f" (last in user code at {fmt_site({'file': m['file'], 'line': m['line'], 'func': m['func']})})"
    return ""
