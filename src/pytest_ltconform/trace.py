"""Rank-side recording: what every rank did, in order, with the user's call site.

A :class:`Recorder` is installed for one job on one rank. It appends one JSON line per event to
the rank's trace file and flushes it, so that a supervisor can read how far a rank got even when
the rank hangs or dies. Recorded:

- hook entries and exits (``[LightningModule]``, ``[Callback]``, ``[Strategy]`` actions), through
  a Lightning ``Profiler``, which is how every rank's position is aligned with the others';
- Python-level ``torch.distributed`` collectives, ``Trainer.save_checkpoint``, the strategy's
  ``barrier``/``broadcast``/``reduce``/``all_gather``, ``LightningModule.all_gather``;
- every ``LightningModule.log`` / ``log_dict`` call with its flags and value type;
- values returned by TorchMetrics functions and ``Metric.forward`` that are later logged, with
  their inputs, so that the pytest side can recompute the epoch-level value.

Each event carries ``site``, the first frame outside torch, lightning, torchmetrics and this
package ("user code"), and ``user``, whether the call came *directly* from user code (only those
are the user's own collective-bearing calls; the ones Lightning makes internally are nested).
This module is imported only inside rank processes.
"""

from __future__ import annotations

import importlib
import json
import os
import threading
import time
import weakref
from typing import Any

from .sites import user_site

COLLECTIVES = (
    "all_reduce", "broadcast", "barrier", "all_gather", "gather", "reduce", "scatter",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "all_to_all", "reduce_scatter", "all_gather_into_tensor", "reduce_scatter_tensor",
    "monitored_barrier", "send", "recv",
)
STRATEGY_CALLS = ("barrier", "broadcast", "reduce", "all_gather", "reduce_boolean_decision")
HOOK_PREFIXES = ("[LightningModule]", "[Callback]", "[LightningDataModule]", "[Strategy]")

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
        # id(tensor) -> (weakref, producer info); for the nonlinear-metric check.
        self._produced: dict[int, tuple[Any, dict]] = {}
        self.per_batch_logs: dict[str, dict] = {}
        self.extra: dict[str, Any] = {}
        self._paused = 0

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
        self.emit({"ev": "hook", "i": index, "name": action, "h": index})

    def hook_exit(self, action: str) -> None:
        with self._lock:
            for pos in range(len(self._hooks) - 1, -1, -1):
                if self._hooks[pos][1] == action:
                    index = self._hooks[pos][0]
                    del self._hooks[pos:]
                    break
            else:
                return
        self.emit({"ev": "hook_exit", "i": index, "h": index})

    # -- patching -------------------------------------------------------------------------------
    def _patch(self, owner: Any, name: str, wrapper_factory) -> None:
        original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if original is None or getattr(original, "__ltconform_wrapped__", False):
            return
        wrapper = wrapper_factory(original)
        wrapper.__ltconform_wrapped__ = True
        wrapper.__wrapped__ = original
        setattr(owner, name, wrapper)
        self._patches.append((owner, name, original))

    def _call_wrapper(self, kind: str, op: str, label: str):
        recorder = self

        def factory(original):
            def wrapper(*args, **kwargs):
                site, direct = user_site()
                parent = recorder._calls[-1] if recorder._calls else None
                event = {"ev": "call", "kind": kind, "op": op, "label": label, "site": site,
                         "user": bool(direct and parent is None), "parent": parent,
                         "hook": recorder.current_hook()}
                if kind == "save":  # patched on the Trainer class: args[0] is the trainer
                    path = args[1] if len(args) > 1 else kwargs.get("filepath")
                    event["path"] = os.fspath(path) if path is not None else None
                seq = recorder.emit(event)
                recorder._calls.append(seq)
                raised = None
                try:
                    return original(*args, **kwargs)
                except BaseException as exc:
                    raised = type(exc).__name__
                    raise
                finally:
                    recorder._calls.pop()
                    exit_event = {"ev": "exit", "of": seq}
                    if raised:
                        # Where the rank was when the collective failed: the hooks unwind next.
                        exit_event["raised"] = raised
                        exit_event["hooks"] = [name for _, name in recorder._hooks]
                    recorder.emit(exit_event)

            return wrapper

        return factory

    def install(self, namespaces: tuple[str, ...]) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name in COLLECTIVES:
            for owner in (dist, c10d):
                if hasattr(owner, name):
                    self._patch(owner, name, self._call_wrapper("collective", name, f"torch.distributed.{name}"))
        for ns in namespaces:
            try:
                mod = importlib.import_module(ns)
            except ImportError:
                continue
            self._patch(mod.Trainer, "save_checkpoint",
                        self._call_wrapper("save", "save_checkpoint", "Trainer.save_checkpoint"))
            self._patch(mod.LightningModule, "all_gather",
                        self._call_wrapper("strategy", "all_gather", "LightningModule.all_gather"))
            self._patch(mod.LightningModule, "log", self._log_wrapper)
            self._patch(mod.LightningModule, "log_dict", self._log_dict_wrapper)
        self._install_metric_taps()

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
        self._produced.clear()
        try:
            self._fh.close()
        except Exception:
            pass

    # -- self.log -------------------------------------------------------------------------------
    def _log_dict_wrapper(self, original):
        recorder = self

        def log_dict(module, dictionary, *args, **kwargs):
            site, direct = user_site()
            keys = [str(k) for k in dict(dictionary).keys()] if hasattr(dictionary, "keys") else []
            recorder.emit({"ev": "log_dict", "keys": keys, "site": site, "user": direct,
                           "hook": getattr(module, "_current_fx_name", None) or recorder.current_hook(),
                           "sync_dist": bool(kwargs.get("sync_dist", False)),
                           "rank_zero_only": bool(kwargs.get("rank_zero_only", False))})
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
            site, direct = user_site()
            try:
                recorder._record_log(module, bound, site, direct)
            except Exception as exc:  # recording must never break the user's run
                recorder.emit({"ev": "trace_error", "where": "log", "error": repr(exc)})
            return original(module, *args, **kwargs)

        return log

    def _record_log(self, module, bound: dict, site, direct: bool) -> None:
        import torch

        if self._paused:
            return
        name = str(bound.get("name"))
        value = bound.get("value")
        hook = getattr(module, "_current_fx_name", None) or self.current_hook()
        vtype = "other"
        try:
            from torchmetrics import Metric

            if isinstance(value, Metric):
                vtype = "metric"
        except ImportError:
            pass
        if vtype == "other":
            if isinstance(value, torch.Tensor):
                vtype = "tensor"
            elif isinstance(value, bool):
                vtype = "other"
            elif isinstance(value, (int, float)):
                vtype = "float"
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
        event = {
            "ev": "log", "name": name, "hook": hook, "site": site, "user": direct,
            "via": "log_dict" if self._log_dict_depth else "log",
            "sync_dist": bool(bound.get("sync_dist", False)),
            "rank_zero_only": bool(bound.get("rank_zero_only", False)),
            "on_step": bool(on_step), "on_epoch": bool(on_epoch),
            "batch_size": bound.get("batch_size") is not None,
            "reduce_fx": reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "custom"),
            "vtype": vtype,
        }
        if vtype in ("tensor", "float"):
            try:
                event["value"] = float(value)
            except Exception:
                pass
        produced = self._producer_of(value) if vtype == "tensor" else None
        if produced is not None:
            event["producer"] = produced["label"]
            if on_epoch and event["reduce_fx"] in ("mean", "avg"):
                self._remember_per_batch(name, event, produced)
        self.emit(event)

    # -- TorchMetrics taps ----------------------------------------------------------------------
    def _producer_of(self, value) -> dict | None:
        entry = self._produced.get(id(value))
        if entry is None or entry[0]() is not value:
            return None
        return entry[1]

    def _tap(self, out, info: dict) -> None:
        import torch

        if isinstance(out, torch.Tensor) and out.numel() == 1:
            if len(self._produced) > 4096:
                self._produced = {k: v for k, v in self._produced.items() if v[0]() is not None}
            self._produced[id(out)] = (weakref.ref(out), info)

    @staticmethod
    def _detach(obj):
        import torch

        if isinstance(obj, torch.Tensor):
            return obj.detach().cpu().clone()
        return obj

    def _install_metric_taps(self) -> None:
        try:
            import torchmetrics
        except ImportError:
            return
        recorder = self

        def metric_forward(original):
            def forward(metric, *args, **kwargs):
                out = original(metric, *args, **kwargs)
                try:
                    recorder._tap(out, {
                        "label": f"the per-batch return value of {type(metric).__name__}",
                        "kind": "metric", "metric": metric,
                        "args": [recorder._detach(a) for a in args],
                        "kwargs": {k: recorder._detach(v) for k, v in kwargs.items()},
                    })
                except Exception:
                    pass
                return out

            return forward

        self._patch(torchmetrics.Metric, "forward", metric_forward)

        def functional(original, qualname):
            def fn(*args, **kwargs):
                out = original(*args, **kwargs)
                try:
                    recorder._tap(out, {
                        "label": f"functional {original.__name__}", "kind": "functional",
                        "fn": qualname, "args": [recorder._detach(a) for a in args],
                        "kwargs": {k: recorder._detach(v) for k, v in kwargs.items()},
                    })
                except Exception:
                    pass
                return out

            return fn

        for mod_name in ("torchmetrics.functional", "torchmetrics.functional.classification",
                         "torchmetrics.functional.regression"):
            try:
                mod = importlib.import_module(mod_name)
            except ImportError:
                continue
            for attr in getattr(mod, "__all__", []):
                target = getattr(mod, attr, None)
                if callable(target) and not isinstance(target, type):
                    qualname = f"{target.__module__}.{target.__name__}"
                    self._patch(mod, attr, lambda orig, q=qualname: functional(orig, q))

    def _remember_per_batch(self, name: str, event: dict, produced: dict) -> None:
        trainer = self.trainer
        stage = None
        run_key = None
        if trainer is not None:
            stage = str(trainer.state.stage)
            run_key = [stage, int(trainer.current_epoch), bool(trainer.sanity_checking),
                       self.extra.get("validation_runs", 0)]
        record = self.per_batch_logs.get(name)
        if record is None or record["run"] != run_key:
            record = {"run": run_key, "hook": event["hook"], "site": event["site"], "via": event["via"],
                      "sync_dist": event["sync_dist"], "producer": produced["label"],
                      "kind": produced["kind"], "calls": []}
            if produced["kind"] == "metric":
                import copy

                template = copy.deepcopy(produced["metric"])
                template.reset()
                record["metric"] = template
            else:
                record["fn"] = produced["fn"]
            self.per_batch_logs[name] = record
        record["calls"].append({"args": produced["args"], "kwargs": produced["kwargs"],
                                "logged": event.get("value")})
