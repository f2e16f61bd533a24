"""Rank-side recording: what every rank did, in order, with the user's call site.

A :class:`Recorder` is installed for one job on one rank. It appends one JSON line per event to
the rank's trace file and flushes it, so that a supervisor can read how far a rank got even when
the rank hangs or dies. Recorded:

- hook entries and exits (``[LightningModule]``, ``[Callback]``, ``[Strategy]`` actions), through
  a Lightning ``Profiler``, which is how every rank's position is aligned with the others';
- Python-level ``torch.distributed`` collectives, ``Trainer.save_checkpoint``, the strategy's
  ``barrier``/``broadcast``/``reduce``/``all_gather``, ``LightningModule.all_gather``;
- every ``LightningModule.log`` / ``log_dict`` call with its flags and value type.

Contracts add their own recording through the public API: :meth:`Recorder.patch` wraps a callable
for the run (undone by :meth:`Recorder.uninstall`), :meth:`Recorder.add_log_tap` lets a probe
annotate each ``log`` event before it is written (sync-dist's metric producers),
:meth:`Recorder.add_call_tap` shows a probe each traced call's arguments before it runs (the
tensors a collective is given),
:meth:`Recorder.call` traces a library call that makes collectives for user code as one
collective-bearing ``call`` event (all-rank-save's metric syncs and DDP forwards), and
:meth:`Recorder.emit` writes an event of their own.

torch's Flight Recorder sees every collective a process group runs, including the ones no tap
knows (a metric sync behind ``trainer.callback_metrics``, FSDP's unsharding, DDP's gradient
all-reduce): :meth:`Recorder.dump_collectives` writes its entries for this job as one
``collectives`` event: when a collective raised, and, without the Python frames (symbolising them
waits on a lock the blocked collective holds), from a thread when the rank has been blocked in a
collective for a second or the supervisor asks it for its stack.

Each event carries ``site``, the first frame outside torch, lightning, torchmetrics and this
package ("user code"), and ``user``, whether the call came *directly* from user code (only those
are the user's own collective-bearing calls; the ones Lightning makes internally are nested).
This module is imported only inside rank processes.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import time
from typing import Any

from .events import CALL, EXIT, FLIGHT_RECORD, HOOK, HOOK_EXIT, LOG, LOG_DICT, TRACE_ERROR
from .sites import library_call, user_site

COLLECTIVES = (
    "all_reduce", "broadcast", "barrier", "all_gather", "gather", "reduce", "scatter",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "all_to_all", "reduce_scatter", "all_gather_into_tensor", "reduce_scatter_tensor",
    "monitored_barrier", "send", "recv",
)
STRATEGY_CALLS = ("barrier", "broadcast", "reduce", "all_gather", "reduce_boolean_decision")
HOOK_PREFIXES = ("[LightningModule]", "[Callback]", "[LightningDataModule]", "[Strategy]")

# A library's own self.log/log_dict override forwards the call: name the line that called it.
_LOG_NAMES = ("log", "log_dict")


class Recorder:
    """Records one job's events on one rank into ``path`` (JSON lines).

    Install with :meth:`install` before the target module is imported (so that names users import
    from torch.distributed or torchmetrics are the recording ones) and remove with
    :meth:`uninstall`; :meth:`attach` binds a Trainer for positions and strategy calls.
    """

    def __init__(self, path: str, rank: int):
        self.path = path
        self.rank = rank
        self._fh = open(path, "a", buffering=1, encoding="utf-8")
        self._lock = threading.RLock()
        self._seq = 0
        self._calls: list[int] = []      # open traced calls (event seq), innermost last
        self._hooks: list[tuple[int, str]] = []  # open hook actions (index, name)
        self._hook_count = 0
        self._patches: list[tuple[Any, str, Any]] = []
        self._log_dict_depth = 0
        self.trainer = None
        self.t0 = time.monotonic()
        self._log_taps: list = []
        self._call_taps: list = []
        self._paused = 0
        self._since_ns = time.time_ns()  # Flight Recorder entries of earlier jobs are not this one's
        self._stop = threading.Event()

    @property
    def recording(self) -> bool:
        """Whether what runs now is the traced run's (False inside :meth:`paused`: a probe's own
        Trainer calls). A probe's own taps that keep state check it, as :meth:`emit` does."""
        return not self._paused

    @property
    def closed(self) -> bool:
        """Whether the trace file is closed (the run on this rank is over)."""
        return self._fh.closed

    def add_log_tap(self, tap) -> None:
        """Call ``tap(event, value)`` for every recorded ``log`` event before it is written;
        the tap may add keys to ``event`` (``value`` is what was logged)."""
        self._log_taps.append(tap)

    @property
    def in_call(self) -> bool:
        """Whether a traced call is running now (a tap sees a collective made inside another
        traced call, such as the all_gather inside all_gather_object, as nested)."""
        return bool(self._calls)

    def add_call_tap(self, tap) -> None:
        """Call ``tap(kind, op, args, kwargs, site)`` before every traced call runs (a collective,
        a strategy call, a checkpoint save), with the call's own arguments: a probe reads what a
        collective is given. A tap that raises is recorded as a ``trace_error``, never passed on."""
        self._call_taps.append(tap)

    def paused(self):
        """Context manager: record nothing inside (a probe's own extra Trainer calls, such as a
        validate or a resume, must not read as the user's run to the other contracts)."""
        import contextlib

        @contextlib.contextmanager
        def pause():
            self._paused += 1
            try:
                yield
            finally:
                self._paused -= 1

        return pause()

    # -- events ---------------------------------------------------------------------------------
    def emit(self, event: dict) -> int:
        if self._paused:
            return 0
        with self._lock:
            self._seq += 1
            event["seq"] = self._seq
            event["t"] = round(time.monotonic() - self.t0, 4)
            if "h" not in event:
                event["h"] = self._hooks[-1][0] if self._hooks else 0
            trainer = self.trainer
            if trainer is not None and "epoch" not in event:
                try:
                    event["epoch"] = int(trainer.current_epoch)
                    event["step"] = int(trainer.global_step)
                    event["sanity"] = bool(trainer.sanity_checking)
                except Exception:  # the trainer is half set up
                    pass
            self._fh.write(json.dumps(event, default=repr) + "\n")
            return self._seq

    def current_hook(self) -> str | None:
        for _, name in reversed(self._hooks):
            if not name.startswith("[Strategy]"):
                return name.split("]", 1)[1]
        return self._hooks[-1][1].split("]", 1)[1] if self._hooks else None

    # -- hooks (driven by the profiler) ---------------------------------------------------------
    def hook_enter(self, action: str) -> None:
        with self._lock:
            self._hook_count += 1
            index = self._hook_count
            self._hooks.append((index, action))
        self.emit(HOOK.new(i=index, name=action, h=index))

    def hook_exit(self, action: str) -> None:
        with self._lock:
            for pos in range(len(self._hooks) - 1, -1, -1):
                if self._hooks[pos][1] == action:
                    index = self._hooks[pos][0]
                    del self._hooks[pos:]
                    break
            else:
                return
        self.emit(HOOK_EXIT.new(i=index, h=index))

    # -- patching -------------------------------------------------------------------------------
    def patch(self, owner: Any, name: str, wrapper_factory, inherited: bool = False) -> None:
        """Replace ``owner.name`` with ``wrapper_factory(original)`` until :meth:`uninstall`; a
        name already wrapped by a recorder is left alone. On a class only its own attribute is
        replaced, unless ``inherited``: then an inherited one is shadowed on ``owner`` and the
        shadow is deleted again."""
        own = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        original = getattr(owner, name, None) if inherited else own
        if original is None or getattr(original, "__ltconform_wrapped__", False):
            return
        wrapper = wrapper_factory(original)
        wrapper.__ltconform_wrapped__ = True
        wrapper.__wrapped__ = original
        setattr(owner, name, wrapper)
        self._patches.append((owner, name, own))

    def call(self, kind: str, op: str, label: str, site: dict | None, direct: bool, **extra):
        """Context manager: trace the code inside as one collective-bearing ``call`` event (and its
        ``exit`` event), for a probe that wraps a library call which makes collectives on behalf
        of user code (a metric sync, a DDP forward). ``site``/``direct`` are where user code made
        the call and whether it made it itself (``user`` is also False inside another traced
        call); ``extra`` keys are added to the event. Collectives made inside are nested."""
        import contextlib

        @contextlib.contextmanager
        def traced():
            parent = self._calls[-1] if self._calls else None
            event = CALL.new(kind=kind, op=op, label=label, site=site, user=bool(direct and parent is None),
                             parent=parent, hook=self.current_hook())
            event.update(extra)
            seq = self.emit(event)
            self._calls.append(seq)
            raised = None
            try:
                yield seq
            except BaseException as exc:
                raised = type(exc).__name__
                raise
            finally:
                self._calls.pop()
                exit_event = EXIT.new(of=seq)
                if raised:
                    # Where the rank was when the collective failed: the hooks unwind next.
                    exit_event["raised"] = raised
                    exit_event["hooks"] = [name for _, name in self._hooks]
                self.emit(exit_event)

        return traced()

    def _call_wrapper(self, kind: str, op: str, label: str):
        recorder = self

        def factory(original):
            def wrapper(*args, **kwargs):
                site, direct = user_site()
                extra = {}
                if site is not None and not direct and not recorder._calls:
                    extra["via"] = library_call()  # the library call of the user's that made this one
                if kind == "save":  # patched on the Trainer class: args[0] is the trainer
                    path = args[1] if len(args) > 1 else kwargs.get("filepath")
                    extra["path"] = os.fspath(path) if path is not None else None
                for tap in recorder._call_taps:
                    try:
                        tap(kind, op, args, kwargs, site)
                    except Exception as exc:  # recording must never break the user's call
                        recorder.emit(TRACE_ERROR.new(where=f"{op} tap", error=repr(exc)))
                with recorder.call(kind, op, label, site, direct, **extra):
                    return original(*args, **kwargs)

            return wrapper

        return factory

    def install(self, namespaces: tuple[str, ...]) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name in COLLECTIVES:
            for owner in (dist, c10d):
                if hasattr(owner, name):
                    self.patch(owner, name, self._call_wrapper("collective", name, f"torch.distributed.{name}"))
        for ns in namespaces:
            try:
                mod = importlib.import_module(ns)
            except ImportError:
                continue
            self.patch(mod.Trainer, "save_checkpoint",
                        self._call_wrapper("save", "save_checkpoint", "Trainer.save_checkpoint"))
            self.patch(mod.LightningModule, "all_gather",
                        self._call_wrapper("strategy", "all_gather", "LightningModule.all_gather"))
            self.patch(mod.LightningModule, "log", self._log_wrapper)
            self.patch(mod.LightningModule, "log_dict", self._log_dict_wrapper)

    # -- every collective (torch's Flight Recorder) -------------------------------------------------
    def dump_collectives(self, frames: bool, why: str) -> None:
        """Write this job's Flight Recorder entries as one ``collectives`` event: per entry the
        process group, ``seq`` (collective sequence id), ``p2p``, ``op``, sizes and, with
        ``frames``, the Python frames of the call (innermost first)."""
        try:
            entries = _flight_recorder_entries(frames)
        except Exception as exc:  # an older torch, or a build without it: nothing to add
            self.emit(TRACE_ERROR.new(where="flight recorder", error=repr(exc)))
            return
        mine = [_compact_entry(e) for e in entries if (e.get("time_created_ns") or 0) >= self._since_ns]
        with self._lock:
            if self._fh.closed:
                return
            # Written without the trainer's position: a dump at the end is not a place in the run.
            self._seq += 1
            event = FLIGHT_RECORD.new(why=why, frames=frames, entries=mine, seq=self._seq)
            self._fh.write(json.dumps(event, default=repr) + "\n")

    def watch_collectives(self, stack_path: str | None) -> None:
        """Dump the collectives (without frames) from a thread when this rank has been blocked in
        one collective for a second, and whenever the supervisor asks for its stack (the
        faulthandler file grows): a rank blocked in a collective cannot do it itself, and a
        supervisor may kill it at any moment after."""

        def watch():
            size, blocked, since, dumped = _size(stack_path), None, 0.0, None
            while not self._stop.wait(0.05):
                now = _size(stack_path)
                if now > size:
                    size = now
                    self.dump_collectives(frames=False, why="stuck")
                state = _in_flight()
                if state != blocked:
                    blocked, since = state, time.monotonic()
                elif state and state != dumped and time.monotonic() - since >= _BLOCKED_S:
                    dumped = state
                    self.dump_collectives(frames=False, why="blocked")

        threading.Thread(target=watch, name="ltconform-collectives", daemon=True).start()

    def attach(self, trainer) -> None:
        """Bind the Trainer: positions come from it, and its strategy's collectives are traced."""
        self.trainer = trainer
        strategy = trainer.strategy
        for name in STRATEGY_CALLS:
            if hasattr(strategy, name):
                bound = getattr(strategy, name)
                wrapper = self._call_wrapper("strategy", name, f"strategy.{name}")(bound)
                object.__setattr__(strategy, name, wrapper)
                self._patches.append((strategy, name, None))

    def uninstall(self) -> None:
        self._stop.set()
        # A collective raised (a timeout, a peer gone): the ranks' collectives show where they parted.
        # Only then: symbolising the frames costs seconds for a full buffer.
        if _collective_raised(sys.exc_info()[1]):
            self.dump_collectives(frames=True, why="raised")
        for owner, name, original in reversed(self._patches):
            if original is None:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
            else:
                setattr(owner, name, original)
        self._patches.clear()
        self.trainer = None
        self._log_taps.clear()
        self._call_taps.clear()
        try:
            self._fh.close()
        except Exception:
            pass

    # -- self.log -------------------------------------------------------------------------------
    def _log_dict_wrapper(self, original):
        recorder = self

        def log_dict(module, dictionary, *args, **kwargs):
            site, direct = user_site(wrappers=_LOG_NAMES)
            keys = [str(k) for k in dict(dictionary).keys()] if hasattr(dictionary, "keys") else []
            recorder.emit(LOG_DICT.new(keys=keys, site=site, user=direct,
                                       hook=getattr(module, "_current_fx_name", None) or recorder.current_hook(),
                                       sync_dist=bool(kwargs.get("sync_dist", False)),
                                       rank_zero_only=bool(kwargs.get("rank_zero_only", False))))
            recorder._log_dict_depth += 1
            try:
                return original(module, dictionary, *args, **kwargs)
            finally:
                recorder._log_dict_depth -= 1

        return log_dict

    def _log_wrapper(self, original):
        recorder = self
        import inspect

        params = list(inspect.signature(original).parameters)[1:]

        def log(module, *args, **kwargs):
            bound = dict(zip(params, args))
            bound.update(kwargs)
            site, direct = user_site(wrappers=_LOG_NAMES)
            try:
                recorder._record_log(module, bound, site, direct)
            except Exception as exc:  # recording must never break the user's run
                recorder.emit(TRACE_ERROR.new(where="log", error=repr(exc)))
            return original(module, *args, **kwargs)

        return log

    def _record_log(self, module, bound: dict, site, direct: bool) -> None:
        if self._paused:
            return
        name = str(bound.get("name"))
        value = bound.get("value")
        hook = getattr(module, "_current_fx_name", None) or self.current_hook()
        vtype = _value_type(value)
        on_step, on_epoch = bound.get("on_step"), bound.get("on_epoch")
        # Lightning's defaults: step-level in *_step hooks of training, epoch-level elsewhere.
        in_train_step = hook in ("training_step", "on_train_batch_start", "on_train_batch_end",
                                 "on_before_backward", "on_after_backward", "on_before_optimizer_step",
                                 "on_before_zero_grad", "optimizer_step")
        if on_step is None:
            on_step = in_train_step
        if on_epoch is None:
            on_epoch = not in_train_step
        reduce_fx = bound.get("reduce_fx", "mean")
        event = LOG.new(
            name=name, hook=hook, site=site, user=direct, via="log_dict" if self._log_dict_depth else "log",
            sync_dist=bool(bound.get("sync_dist", False)), rank_zero_only=bool(bound.get("rank_zero_only", False)),
            on_step=bool(on_step), on_epoch=bool(on_epoch), batch_size=bound.get("batch_size") is not None,
            reduce_fx=reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "custom"),
            vtype=vtype,
        )
        if vtype in ("tensor", "float"):
            try:
                # detached: float() of a tensor that requires grad warns, as if the user's code did
                event["value"] = float(value.detach() if hasattr(value, "detach") else value)
            except Exception:
                pass
        for tap in self._log_taps:
            tap(event, value)
        self.emit(event)


_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep


def _collective_raised(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or the exception it was raised from) came out of torch.distributed."""
    for err in (exc, getattr(exc, "__cause__", None) or getattr(exc, "__context__", None)):
        tb = getattr(err, "__traceback__", None)
        while tb is not None:
            if _DISTRIBUTED in tb.tb_frame.f_code.co_filename:
                return True
            tb = tb.tb_next
    return False


# A collective still open after this long is a wait, not a transfer.
_BLOCKED_S = 1.0


def _in_flight() -> tuple | None:
    """The process groups' collectives enqueued but not completed (``((pg, last enqueued), ...)``),
    from the Flight Recorder's status alone (cheap); None when nothing is open."""
    import pickle

    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        status = pickle.loads(_dump_fr_trace(includeCollectives=False, includeStackTraces=False,
                                             onlyActive=True)).get("pg_status") or {}
    except Exception:
        return None
    open_ = tuple(sorted((str(pg), s.get("last_enqueued_collective")) for pg, s in status.items()
                         if (s.get("last_enqueued_collective") or 0) > (s.get("last_completed_collective") or 0)))
    return open_ or None


def _size(path: str | None) -> int:
    if not path:
        return -1
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def _flight_recorder_entries(frames: bool) -> list[dict]:
    import pickle

    from torch._C._distributed_c10d import _dump_fr_trace

    dump = pickle.loads(_dump_fr_trace(includeCollectives=True, includeStackTraces=frames, onlyActive=False))
    return list(dump.get("entries") or [])


# Frames of torch.distributed's own wrappers are the same for every collective.
_FR_SKIP = (os.sep + "distributed_c10d.py", os.sep + "c10d_logger.py")


def _compact_entry(entry: dict) -> dict:
    group = entry.get("process_group") or ("", "")
    frames = [[f.get("filename"), f.get("line"), f.get("name")] for f in entry.get("frames") or []
              if not str(f.get("filename", "")).endswith(_FR_SKIP)]
    return {"pg": str(group[0]), "seq": entry.get("collective_seq_id"), "p2p": entry.get("p2p_seq_id"),
            "is_p2p": bool(entry.get("is_p2p")), "op": str(entry.get("profiling_name", "")).split(":", 1)[-1],
            "sizes": entry.get("input_sizes"), "frames": frames[:40]}


def _value_type(value) -> str:
    """'metric' (a TorchMetrics object), 'tensor', 'float' (a Python number) or 'other'."""
    import torch

    try:
        from torchmetrics import Metric

        if isinstance(value, Metric):
            return "metric"
    except ImportError:
        pass
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, bool):
        return "other"
    if isinstance(value, (int, float)):
        return "float"
    return "other"
