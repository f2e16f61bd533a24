"""Rank side of sync-dist, in the traced fit (imported only inside rank processes).

- An observer callback snapshots what every rank decides after every validation and epoch
  (monitored values, ``should_stop``); after fit, the final metrics, decisions and monitors.
- Values returned by TorchMetrics functions and ``Metric.forward`` are tapped; when one, or a sum
  or mean of a few of one step's outputs, is logged as a mean-reduced epoch metric, the inputs of
  every part on every batch are kept so that the pytest side can recompute the epoch-level value.
- ``Trainer.should_stop`` is watched while it is set (a ``decision`` trace event, with the user's
  call site, survives a hang); each optimizer's learning rates are noted when they change.
- Epoch-mean logs without ``batch_size``: the count Lightning infers from the batch next to the
  batch's number of samples, with the logged value.

- Every monitored value a callback reads, where it reads it (EarlyStopping's check, the top-k
  check of ModelCheckpoint, a ReduceLROnPlateau scheduler's value): ``reads``, one record per
  read with the callback, its key, the hook it ran in, epoch, global step and the value.

Observations: ``{"final": ..., "snapshots": [...], "per_batch": {key: record},
"weights": {key: record}, "lr_changes": [...], "reads": [...]}``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import os
import sys
import weakref
from typing import Any

from ...events import Recorded, declare
from ...runs import Probe
from ...sites import user_site
from .batches import count_samples, loader_batch_size
from .combos import find_combinations


class DecisionEvent(Recorded):
    """A decision the Trainer acts on everywhere (``name``: should_stop, ...) set to ``value`` at
    ``site`` (``user``) in ``hook``, while the Trainer ran ``action``."""

    name: str
    value: object
    site: dict | None
    user: bool
    hook: str | None
    action: str | None


DECISION = declare("decision", DecisionEvent)

# Metric functions whose per-batch values a logged epoch mean may be made of: every public function
# of these packages, wherever the user imports it from (``torchmetrics.functional.classification.
# calibration_error``, a re-export, ``sklearn.metrics.f1_score``). A package imported only later by
# the user's module (scikit-learn) is tapped as it is imported.
_FUNCTION_PACKAGES = ("torchmetrics.functional", "sklearn.metrics")
_STEP_HOOKS = ("training_step", "validation_step", "test_step")
_MAX_PARTS_POOL = 8  # the last tapped outputs of a step a logged value may be made of


class _WatchedProperty(property):
    __ltconform__ = True


def _part_keys(taps: list[dict]) -> list[str]:
    """A key per tapped output that is the same on every rank: producer name and occurrence."""
    seen: dict[str, int] = {}
    keys = []
    for tap in taps:
        name = tap["info"]["name"]
        keys.append(f"{name}#{seen.get(name, 0)}")
        seen[name] = seen.get(name, 0) + 1
    return keys


def _part(info: dict, key: str, value: float | None = None) -> dict:
    """One component of a logged value: its producer and this batch's inputs (plain data, and
    the Metric object itself, which the record turns into a reset template)."""
    part = {"key": key, "label": info["label"], "kind": info["kind"], "name": info["name"],
            "args": info["args"], "kwargs": info["kwargs"], "value": value}
    if info["kind"] == "metric":
        part["metric"] = info["metric"]
    else:
        part["fn"] = info["fn"]
    return part


def _float_or_none(value) -> float | None:
    try:
        return float(value)
    except Exception:
        return None


def _detach(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    copy_ = getattr(obj, "copy", None)  # a NumPy array: this batch's values, not a view the step reuses
    if callable(copy_) and hasattr(obj, "ndim"):
        return copy_()
    return obj


def _group_of_several(metric, kwargs: dict) -> bool:
    try:
        import torch.distributed as dist

        group = kwargs.get("process_group") or getattr(metric, "process_group", None)
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    except Exception:  # a group this rank is not part of
        return False


def _scalar(out) -> float | None:
    """A metric function's output as a number: a one-element tensor, a Python or NumPy number."""
    import torch

    if isinstance(out, torch.Tensor):
        return float(out) if out.numel() == 1 else None
    if isinstance(out, (bool, str)) or not hasattr(out, "__float__") or getattr(out, "ndim", 0):
        return None
    try:
        return float(out)
    except (TypeError, ValueError):
        return None


def _metric_functions(module) -> list[tuple[str, Any]]:
    """(name, function) of ``module``'s public functions defined in one of :data:`_FUNCTION_PACKAGES`."""
    found = []
    for name in getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]:
        fn = getattr(module, name, None)
        home = getattr(fn, "__module__", None) or ""
        if callable(fn) and not isinstance(fn, type) and home.startswith(_FUNCTION_PACKAGES):
            found.append((name, fn))
    return found


class _MetaPath(list):
    """``sys.meta_path`` with a finder in front while a run is traced (a list that takes the
    recorder's marks; the recorder puts the original list back)."""


class _TapOnImport:
    """A ``sys.meta_path`` finder that runs ``tap(module)`` on each module of ``packages`` right after
    it is imported (the user's ``from sklearn.metrics import f1_score`` then gets the tapped one);
    it finds nothing itself."""

    def __init__(self, packages: tuple[str, ...], tap):
        self.packages, self.tap, self._busy = packages, tap, set()

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(self.packages) or fullname in self._busy:
            return None
        import importlib.util

        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        loader = getattr(spec, "loader", None) if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original, tap = loader.exec_module, self.tap

        class Loader:
            def __getattr__(self, name):
                return getattr(loader, name)

            def create_module(self, spec_):
                return loader.create_module(spec_)

            def exec_module(self, module):
                original(module)
                with contextlib.suppress(Exception):  # an observation: never the user's import's failure
                    tap(module)

        spec.loader = Loader()
        return spec


def _make_observer(ns: Any, probe: SyncDistProbe):
    state = probe.state

    class Observer(ns.Callback):
        """Snapshots what every rank decides: monitored values, should_stop, best checkpoints, LRs."""

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

        def on_train_epoch_start(self, trainer, pl_module):
            probe.note_lrs(trainer, "on_train_epoch_start")

        def on_train_epoch_end(self, trainer, pl_module):
            self._snapshot(trainer, "train_epoch_end")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            probe.batch_started(trainer, batch, "train", 0)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            probe.note_lrs(trainer, "on_train_batch_end")

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            probe.batch_started(trainer, batch, "val", dataloader_idx)

        def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            probe.batch_started(trainer, batch, "test", dataloader_idx)

    return Observer()


def _callback_facts(trainer, ns: Any, built_at: Any = None) -> tuple[list, list, list]:
    """(best checkpoints, early stopping states, monitors) of the Trainer's callbacks and schedulers;
    ``built_at`` maps a ModelCheckpoint to where the user's code built it."""
    callbacks_mod = importlib.import_module(f"{ns.__name__}.callbacks")
    checkpoints, early, monitors = [], [], []
    for cb in trainer.callbacks:
        if isinstance(cb, callbacks_mod.ModelCheckpoint):
            checkpoints.append({
                "monitor": cb.monitor,
                "best_model_path": os.path.basename(cb.best_model_path or ""),
                "best_model_score": _float_or_none(cb.best_model_score),
                "best_k": sorted(os.path.basename(p) for p in cb.best_k_models),
                "filename": cb.filename if isinstance(cb.filename, str) else None,
                "site": (built_at or {}).get(cb),
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


def collect_final(trainer, ns: Any, built_at: Any = None) -> dict:
    """Plain-data summary of what each rank ended with: metrics, decisions, monitors."""
    checkpoints, early, monitors = _callback_facts(trainer, ns, built_at)
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
        self.state: dict = {"snapshots": [], "validation_runs": 0, "lr_changes": [], "reads": []}
        # id(tensor) -> (weakref, producer info); for the nonlinear-metric check.
        self.produced: dict[int, tuple[Any, dict]] = {}
        self.step_taps: list[dict] = []  # this batch's tapped outputs, for values derived from them
        self.per_batch: dict[str, dict] = {}
        self.weights: dict[str, dict] = {}  # epoch-mean logs without batch_size: inferred vs samples
        self.recorder = None
        self._batch: tuple | None = None  # (trainer, batch, stage, dataloader_idx)
        self._sample_path: dict[tuple, tuple] = {}  # (stage, idx) -> leaf holding one row per sample
        self._last_lrs = None
        self._patched_trainer = None
        self.checkpoints_built_at: Any = weakref.WeakKeyDictionary()  # ModelCheckpoint -> user site
        # id(tensor) -> (weakref, facts) of what a Metric's compute() returned, and whether its state
        # was gathered over the ranks first (its ``_sync_dist`` ran); the last few as numbers.
        self.computed: dict[int, tuple[Any, dict]] = {}
        self.compute_taps: list[dict] = []
        self._syncs: dict[int, int] = {}  # id(metric) -> state gathers during its compute() now running
        self._forward_depth = 0  # inside Metric.forward (its compute() is the per-batch value)

    # -- taps, installed before the user's module imports TorchMetrics names -----------------------
    def install(self, recorder) -> None:
        self.recorder = recorder
        recorder.add_log_tap(self._on_log)
        for ns in ("lightning.pytorch", "pytorch_lightning"):
            if ns in sys.modules:  # where the user's code builds each ModelCheckpoint: its filename's site
                callbacks = importlib.import_module(f"{ns}.callbacks")
                recorder.patch(callbacks.ModelCheckpoint, "__init__", self._checkpoint_init)
                self._tap_reads(recorder, ns, callbacks)
        try:
            import torchmetrics
            import torchmetrics.functional  # noqa: F401 (imports its submodules: each is tapped below)
        except ImportError:
            torchmetrics = None
        if torchmetrics is not None:
            recorder.patch(torchmetrics.Metric, "forward", self._metric_forward)
            recorder.patch(torchmetrics.Metric, "_wrap_compute", self._metric_wrap_compute)
            # (``_sync_dist`` is all-rank-save's tap; ``sync`` sets ``_is_synced`` once it gathered)
            recorder.patch(torchmetrics.Metric, "sync", self._metric_sync)
        for name in [n for n in sys.modules if n.startswith(_FUNCTION_PACKAGES)]:
            self._tap_functions(sys.modules[name])
        if "sklearn.metrics" not in sys.modules:  # tapped if and when the user's code imports it
            finder = _TapOnImport(("sklearn.metrics",), self._tap_functions)
            recorder.patch(sys, "meta_path", lambda original: _MetaPath([finder, *original]))

    def _tap_functions(self, module) -> None:
        """Tap every metric function ``module`` holds (see :data:`_FUNCTION_PACKAGES`)."""
        if module is None or self.recorder is None:
            return
        for attr, target in _metric_functions(module):
            qualname = f"{target.__module__}.{getattr(target, '__name__', attr)}"
            self.recorder.patch(module, attr, lambda orig, q=qualname: self._functional(orig, q))

    def _checkpoint_init(self, original):
        built_at = self.checkpoints_built_at

        def __init__(callback, *args, **kwargs):
            original(callback, *args, **kwargs)
            with contextlib.suppress(Exception):  # an observation: never the user's construction's failure
                site, _ = user_site()
                if site is not None:
                    built_at.setdefault(callback, site)  # a subclass's own __init__ calls this one too

        return __init__

    # -- the monitored values callbacks read, where they read them ----------------------------------
    def _tap_reads(self, recorder, ns: str, callbacks) -> None:
        """Tap the three places Lightning reads a monitored value: EarlyStopping's check, the top-k
        check of ModelCheckpoint (``check_monitor_top_k``, given the value it ranks), and the epoch
        loop's value for a ReduceLROnPlateau scheduler; each read is a ``reads`` record with the
        value this rank's callback decided on."""
        loop = importlib.import_module(f"{ns}.loops.training_epoch_loop")._TrainingEpochLoop

        def early(original):
            def _run_early_stopping_check(callback, trainer):
                self._read("EarlyStopping", callback, callback.monitor, trainer,
                           lambda: trainer.callback_metrics.get(callback.monitor))
                return original(callback, trainer)
            return _run_early_stopping_check

        def topk(original):  # (_save_topk_checkpoint is all-rank-save's tap already)
            def check_monitor_top_k(callback, trainer, current=None):
                self._read("ModelCheckpoint", callback, callback.monitor, trainer, lambda: current)
                return original(callback, trainer, current)
            return check_monitor_top_k

        def plateau(original):
            def _get_monitor_value(epoch_loop, key):
                value = original(epoch_loop, key)
                self._read("ReduceLROnPlateau", None, key, epoch_loop.trainer, lambda: value,
                           hook="the learning-rate update")
                return value
            return _get_monitor_value

        recorder.patch(callbacks.EarlyStopping, "_run_early_stopping_check", early)
        recorder.patch(callbacks.ModelCheckpoint, "check_monitor_top_k", topk)
        recorder.patch(loop, "_get_monitor_value", plateau)

    def _read(self, owner: str, callback, key: str, trainer, value, hook: str | None = None) -> None:
        if self.recorder is not None and not self.recorder.recording:
            return  # a probe's own fit (all-rank-save's sharded resume): not the user's run's read
        with contextlib.suppress(Exception):  # an observation: never the user's callback's failure
            same_kind = [c for c in trainer.callbacks if type(c).__name__ == type(callback).__name__] \
                if callback is not None else []
            if hook is None and self.recorder is not None:
                hook = self.recorder.current_hook()
            self.state["reads"].append({
                "owner": owner, "cls": type(callback).__name__ if callback is not None else owner,
                "n": next((i for i, c in enumerate(same_kind) if c is callback), 0), "key": key,
                "hook": (hook or "").rsplit(".", 1)[-1] or None, "epoch": int(trainer.current_epoch),
                "step": int(trainer.global_step), "sanity": bool(trainer.sanity_checking),
                "value": _float_or_none(value())})

    def _metric_forward(self, original):
        probe = self

        def forward(metric, *args, **kwargs):
            probe._forward_depth += 1
            try:
                out = original(metric, *args, **kwargs)
            finally:
                probe._forward_depth -= 1
            try:
                probe._tap(out, {"label": f"the per-batch return value of {type(metric).__name__}",
                                 "kind": "metric", "name": type(metric).__name__, "metric": metric,
                                 "args": [_detach(a) for a in args],
                                 "kwargs": {k: _detach(v) for k, v in kwargs.items()}})
            except Exception:
                pass
            return out

        return forward

    def _metric_wrap_compute(self, original):
        """``Metric._wrap_compute``: the compute() it wraps also notes its value and whether the
        metric gathered its state over the ranks for it (outside ``forward``)."""
        probe = self

        def wrap(metric, compute):
            inner = original(metric, compute)

            def compute_and_note(*args, **kwargs):
                if probe._forward_depth:
                    return inner(*args, **kwargs)
                probe._syncs[id(metric)] = 0
                out = inner(*args, **kwargs)
                try:
                    probe._note_compute(metric, out, probe._syncs.pop(id(metric), 0) > 0)
                except Exception:
                    pass
                return out

            return compute_and_note

        return wrap

    def _metric_sync(self, original):
        """``Metric.sync``: a gather of the state over a group of 2+ ranks, counted for the compute()
        running now (``sync`` returns early, ``_is_synced`` unset, when it does not gather)."""
        probe = self

        def sync(metric, *args, **kwargs):
            out = original(metric, *args, **kwargs)
            counting = id(metric) in probe._syncs
            if counting and getattr(metric, "_is_synced", False) and _group_of_several(metric, kwargs):
                probe._syncs[id(metric)] += 1
            return out

        return sync

    def _note_compute(self, metric, out, synced: bool) -> None:
        import torch

        value = _scalar(out)
        if value is None or (self.recorder is not None and not self.recorder.recording):
            return
        known = self.computed.get(id(out))
        if known is not None and known[0]() is out:
            return  # the cached value of an earlier compute(): its facts stand
        facts = {"metric": type(metric).__name__, "synced": synced}
        if isinstance(out, torch.Tensor):
            if len(self.computed) > 1024:
                self.computed = {k: v for k, v in self.computed.items() if v[0]() is not None}
            self.computed[id(out)] = (weakref.ref(out), facts)
        self.compute_taps = [*self.compute_taps[-15:], {"hook": self._fx_name(), "value": value, "facts": facts}]

    def _computed_by(self, event: dict, value) -> dict | None:
        """The facts of the Metric compute() whose value this log call logs: the same tensor, or, for
        a number, the last compute() of the same hook that returned that number."""
        if event["vtype"] == "tensor":
            entry = self.computed.get(id(value))
            return entry[1] if entry is not None and entry[0]() is value else None
        if event["vtype"] == "float" and event.get("value") is not None:
            for tap in reversed(self.compute_taps):
                if tap["hook"] == event["hook"] and tap["value"] == event["value"]:
                    return tap["facts"]
        return None

    def _functional(self, original, qualname: str):
        probe = self

        def fn(*args, **kwargs):
            out = original(*args, **kwargs)
            try:
                label = f"scikit-learn's {original.__name__}" if qualname.startswith("sklearn.") else \
                    f"functional {original.__name__}"
                probe._tap(out, {"label": label, "kind": "functional",
                                 "fn": qualname, "name": original.__name__, "args": [_detach(a) for a in args],
                                 "kwargs": {k: _detach(v) for k, v in kwargs.items()}})
            except Exception:
                pass
            return out

        return fn

    def _tap(self, out, info: dict) -> None:
        import torch

        if self.recorder is not None and not self.recorder.recording:
            return  # a metric computed in a probe's own fit, not in the user's run
        value = _scalar(out)
        if value is None:
            return
        if isinstance(out, torch.Tensor):  # a number has no identity to find it by: its value matches it
            if len(self.produced) > 4096:
                self.produced = {k: v for k, v in self.produced.items() if v[0]() is not None}
            self.produced[id(out)] = (weakref.ref(out), info)
        if len(self.step_taps) >= 32:
            del self.step_taps[0]
        self.step_taps.append({"hook": self._fx_name(), "id": id(out), "value": value, "info": info})

    def _fx_name(self) -> str | None:
        """The hook running now, as ``self.log`` events name it."""
        try:
            name = self.recorder.trainer.lightning_module._current_fx_name
        except Exception:
            name = None
        return name or (self.recorder.current_hook() if self.recorder is not None else None)

    def _producer_of(self, value) -> dict | None:
        entry = self.produced.get(id(value))
        if entry is None or entry[0]() is not value:
            return None
        return entry[1]

    def _on_log(self, event: dict, value) -> None:
        produced = self._producer_of(value) if event["vtype"] == "tensor" else None
        if produced is not None:
            event["producer"] = produced["label"]
        computed = self._computed_by(event, value) if produced is None else None
        if computed is not None:
            event["metric_compute"] = computed
        if not (event["on_epoch"] and event["reduce_fx"] in ("mean", "avg")):
            return
        combos = self._combos(event, value, produced)
        if combos:
            self._remember_per_batch(event, combos)
        if not event["batch_size"] and event.get("value") is not None and event["hook"] in _STEP_HOOKS:
            self._remember_weight(event)

    def _combos(self, event: dict, value, produced: dict | None) -> dict:
        """{signature: {"mode", "parts"}}: the ways the logged value is made of this step's tapped
        outputs (the output itself, or the sum or mean of a few of them)."""
        taps = [t for t in self.step_taps if t["hook"] == event["hook"]][-_MAX_PARTS_POOL:]
        keys = _part_keys(taps)
        if produced is not None:
            index = next((i for i, t in enumerate(taps) if t["id"] == id(value)), None)
            key = keys[index] if index is not None else f"{produced['name']}#0"
            return {f"single|{key}": {"mode": "single", "parts": [_part(produced, key, event.get("value"))]}}
        if event.get("value") is None or not taps:
            return {}
        found = {}
        for mode, indices in find_combinations(event["value"], [t["value"] for t in taps]):
            sig = f"{mode}|" + ",".join(keys[i] for i in indices)
            found[sig] = {"mode": mode, "parts": [_part(taps[i]["info"], keys[i], taps[i]["value"])
                                                  for i in indices]}
        return found

    def _run_key(self) -> list | None:
        trainer = self.recorder.trainer
        if trainer is None:
            return None
        return [str(trainer.state.stage), int(trainer.current_epoch), bool(trainer.sanity_checking),
                self.state["validation_runs"]]

    def _remember_per_batch(self, event: dict, combos: dict) -> None:
        name, run_key = event["name"], self._run_key()
        record = self.per_batch.get(name)
        if record is None or record["run"] != run_key:
            record = {"run": run_key, "hook": event["hook"], "site": event["site"], "via": event["via"],
                      "sync_dist": event["sync_dist"], "rank_zero_only": event.get("rank_zero_only", False),
                      "vtype": event.get("vtype"), "batches": [], "templates": {}}
            self.per_batch[name] = record
        for combo in combos.values():
            for part in combo["parts"]:
                metric = part.pop("metric", None)
                if metric is not None and part["key"] not in record["templates"]:
                    template = copy.deepcopy(metric)
                    template.reset()
                    record["templates"][part["key"]] = template
        record["batches"].append({"logged": event.get("value"), "combos": combos})

    # -- Lightning's batch-size inference for epoch means -----------------------------------------
    def batch_started(self, trainer, batch, stage: str, dataloader_idx: int) -> None:
        self.step_taps.clear()
        self._batch = (trainer, batch, stage, int(dataloader_idx or 0))

    def _remember_weight(self, event: dict) -> None:
        if self._batch is None:
            return
        trainer, batch, stage, idx = self._batch
        counted = count_samples(batch, loader_batch_size(trainer, stage, idx), self._sample_path, (stage, idx))
        if counted is None:
            return
        name, run_key = event["name"], self._run_key()
        record = self.weights.get(name)
        if record is None or record["run"] != run_key:
            record = {"run": run_key, "hook": event["hook"], "site": event["site"],
                      "sync_dist": event["sync_dist"], "batches": []}
            self.weights[name] = record
        record["batches"].append({"value": event["value"], **counted})

    # -- decisions: should_stop as it is set, learning rates as schedulers move them ----------------
    def note_lrs(self, trainer, hook: str) -> None:
        try:
            lrs = [[float(g["lr"]) for g in opt.param_groups] for opt in trainer.optimizers]
        except Exception:
            return
        if lrs != self._last_lrs:
            self._last_lrs = lrs
            self.state["lr_changes"].append({"epoch": int(trainer.current_epoch), "step": int(trainer.global_step),
                                             "hook": hook, "lrs": lrs})

    def _watch_should_stop(self, trainer_cls) -> None:
        """Make ``Trainer.should_stop`` a property that emits a ``decision`` event at every change,
        with the user's call site, so a decision one rank took is seen where it was taken."""
        current = vars(trainer_cls).get("should_stop")
        if current is not None and not getattr(current, "__ltconform__", False):
            return
        probe = self

        def get(trainer):
            return trainer.__dict__.get("should_stop", False)

        def set_(trainer, value):
            old = trainer.__dict__.get("should_stop", False)
            trainer.__dict__["should_stop"] = value
            if bool(old) != bool(value):
                try:
                    site, direct = user_site()
                    probe._decided("should_stop", bool(value), site, direct)
                except Exception:  # recording must never break the user's run
                    pass

        prop = _WatchedProperty(get, set_)
        trainer_cls.should_stop = prop
        self._patched_trainer = trainer_cls

    def _decided(self, name: str, value, site, direct: bool) -> None:
        recorder = self.recorder
        if recorder is None or recorder.closed:
            return
        recorder.emit({"ev": DECISION, "name": name, "value": value, "site": site, "user": direct,
                       "hook": self._fx_name(), "action": recorder.current_hook()})

    def _unwatch(self) -> None:
        if self._patched_trainer is not None:
            try:
                delattr(self._patched_trainer, "should_stop")
            except AttributeError:
                pass
            self._patched_trainer = None

    # -- the run ----------------------------------------------------------------------------------
    def before_trainer(self, objects, trainer_kwargs, recorder) -> None:
        self._watch_should_stop(objects.ns.Trainer)
        trainer_kwargs["callbacks"] = list(trainer_kwargs.get("callbacks") or []) + \
            [_make_observer(objects.ns, self)]

    def collect(self, objects, trainer, recorder) -> dict:
        self._unwatch()
        return {"final": collect_final(trainer, objects.ns, self.checkpoints_built_at),
                "snapshots": self.state["snapshots"], "per_batch": self.per_batch, "weights": self.weights,
                "lr_changes": self.state["lr_changes"], "reads": self.state["reads"]}
