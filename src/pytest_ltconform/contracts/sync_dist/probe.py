"""Rank side of sync-dist, in the traced fit (imported only inside rank processes).

- An observer callback snapshots what every rank decides after every validation and epoch
  (monitored values, ``should_stop``); after fit, the final metrics, decisions and monitors.
- Values returned by TorchMetrics functions and ``Metric.forward`` are tapped; when one is then
  logged, its ``log`` event names the producer and, for a mean-reduced epoch metric, the inputs of
  every batch are kept so that the pytest side can recompute the epoch-level value.

Observations: ``{"final": ..., "snapshots": [...], "per_batch": {key: record}}``.
"""

from __future__ import annotations

import copy
import importlib
import os
import weakref
from typing import Any

from ...harness import Probe

_FUNCTIONAL_MODULES = ("torchmetrics.functional", "torchmetrics.functional.classification",
                       "torchmetrics.functional.regression")


def _float_or_none(value) -> float | None:
    try:
        return float(value)
    except Exception:
        return None


def _detach(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    return obj


def _make_observer(ns: Any, state: dict):
    class Observer(ns.Callback):
        """Snapshots what every rank decides: monitored values, should_stop, best checkpoints."""

        def _snapshot(self, trainer, event: str) -> None:
            metrics = {}
            for key, value in trainer.callback_metrics.items():
                try:
                    metrics[key] = float(value)
                except Exception:
                    pass
            state["snapshots"].append({"event": event, "epoch": int(trainer.current_epoch),
                                       "step": int(trainer.global_step), "metrics": metrics,
                                       "should_stop": bool(trainer.should_stop)})

        def on_validation_start(self, trainer, pl_module):
            if not trainer.sanity_checking:
                state["validation_runs"] += 1

        def on_validation_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                self._snapshot(trainer, "validation_end")

        def on_train_epoch_end(self, trainer, pl_module):
            self._snapshot(trainer, "train_epoch_end")

    return Observer()


def _callback_facts(trainer, ns: Any) -> tuple[list, list, list]:
    """(best checkpoints, early stopping states, monitors) of the Trainer's callbacks and schedulers."""
    callbacks_mod = importlib.import_module(f"{ns.__name__}.callbacks")
    checkpoints, early, monitors = [], [], []
    for cb in trainer.callbacks:
        if isinstance(cb, callbacks_mod.ModelCheckpoint):
            checkpoints.append({
                "monitor": cb.monitor,
                "best_model_path": os.path.basename(cb.best_model_path or ""),
                "best_model_score": _float_or_none(cb.best_model_score),
                "best_k": sorted(os.path.basename(p) for p in cb.best_k_models),
            })
            if cb.monitor:
                monitors.append({"key": cb.monitor, "owner": "ModelCheckpoint"})
        elif isinstance(cb, callbacks_mod.EarlyStopping):
            early.append({"monitor": cb.monitor, "stopped_epoch": int(cb.stopped_epoch),
                          "wait_count": int(cb.wait_count)})
            monitors.append({"key": cb.monitor, "owner": "EarlyStopping"})
    for config in getattr(trainer, "lr_scheduler_configs", []) or []:
        if getattr(config, "monitor", None) and getattr(config, "reduce_on_plateau", False):
            monitors.append({"key": config.monitor, "owner": type(config.scheduler).__name__})
    return checkpoints, early, monitors


def collect_final(trainer, ns: Any) -> dict:
    """Plain-data summary of what each rank ended with: metrics, decisions, monitors."""
    checkpoints, early, monitors = _callback_facts(trainer, ns)
    return {
        "callback_metrics": {k: _float_or_none(v) for k, v in trainer.callback_metrics.items()},
        "should_stop": bool(trainer.should_stop),
        "current_epoch": int(trainer.current_epoch),
        "global_step": int(trainer.global_step),
        "checkpoints": checkpoints,
        "early_stopping": early,
        "monitors": monitors,
    }


class SyncDistProbe(Probe):
    def __init__(self):
        self.state: dict = {"snapshots": [], "validation_runs": 0}
        # id(tensor) -> (weakref, producer info); for the nonlinear-metric check.
        self.produced: dict[int, tuple[Any, dict]] = {}
        self.per_batch: dict[str, dict] = {}
        self.recorder = None

    # -- taps, installed before the user's module imports TorchMetrics names -----------------------
    def install(self, recorder) -> None:
        self.recorder = recorder
        recorder.add_log_tap(self._on_log)
        try:
            import torchmetrics
        except ImportError:
            return
        recorder.patch(torchmetrics.Metric, "forward", self._metric_forward)
        for mod_name in _FUNCTIONAL_MODULES:
            try:
                mod = importlib.import_module(mod_name)
            except ImportError:
                continue
            for attr in getattr(mod, "__all__", []):
                target = getattr(mod, attr, None)
                if callable(target) and not isinstance(target, type):
                    qualname = f"{target.__module__}.{target.__name__}"
                    recorder.patch(mod, attr, lambda orig, q=qualname: self._functional(orig, q))

    def _metric_forward(self, original):
        probe = self

        def forward(metric, *args, **kwargs):
            out = original(metric, *args, **kwargs)
            try:
                probe._tap(out, {"label": f"the per-batch return value of {type(metric).__name__}",
                                 "kind": "metric", "metric": metric, "args": [_detach(a) for a in args],
                                 "kwargs": {k: _detach(v) for k, v in kwargs.items()}})
            except Exception:
                pass
            return out

        return forward

    def _functional(self, original, qualname: str):
        probe = self

        def fn(*args, **kwargs):
            out = original(*args, **kwargs)
            try:
                probe._tap(out, {"label": f"functional {original.__name__}", "kind": "functional",
                                 "fn": qualname, "args": [_detach(a) for a in args],
                                 "kwargs": {k: _detach(v) for k, v in kwargs.items()}})
            except Exception:
                pass
            return out

        return fn

    def _tap(self, out, info: dict) -> None:
        import torch

        if isinstance(out, torch.Tensor) and out.numel() == 1:
            if len(self.produced) > 4096:
                self.produced = {k: v for k, v in self.produced.items() if v[0]() is not None}
            self.produced[id(out)] = (weakref.ref(out), info)

    def _producer_of(self, value) -> dict | None:
        entry = self.produced.get(id(value))
        if entry is None or entry[0]() is not value:
            return None
        return entry[1]

    def _on_log(self, event: dict, value) -> None:
        produced = self._producer_of(value) if event["vtype"] == "tensor" else None
        if produced is None:
            return
        event["producer"] = produced["label"]
        if event["on_epoch"] and event["reduce_fx"] in ("mean", "avg"):
            self._remember_per_batch(event["name"], event, produced)

    def _remember_per_batch(self, name: str, event: dict, produced: dict) -> None:
        trainer = self.recorder.trainer
        run_key = None
        if trainer is not None:
            run_key = [str(trainer.state.stage), int(trainer.current_epoch), bool(trainer.sanity_checking),
                       self.state["validation_runs"]]
        record = self.per_batch.get(name)
        if record is None or record["run"] != run_key:
            record = {"run": run_key, "hook": event["hook"], "site": event["site"], "via": event["via"],
                      "sync_dist": event["sync_dist"], "producer": produced["label"],
                      "kind": produced["kind"], "calls": []}
            if produced["kind"] == "metric":
                template = copy.deepcopy(produced["metric"])
                template.reset()
                record["metric"] = template
            else:
                record["fn"] = produced["fn"]
            self.per_batch[name] = record
        record["calls"].append({"args": produced["args"], "kwargs": produced["kwargs"],
                                "logged": event.get("value")})

    # -- the run ----------------------------------------------------------------------------------
    def before_trainer(self, objects, trainer_kwargs, recorder) -> None:
        trainer_kwargs["callbacks"] = list(trainer_kwargs.get("callbacks") or []) + \
            [_make_observer(objects.ns, self.state)]

    def collect(self, objects, trainer, recorder) -> dict:
        return {"final": collect_final(trainer, objects.ns), "snapshots": self.state["snapshots"],
                "per_batch": self.per_batch}
