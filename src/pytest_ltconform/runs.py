"""Rank-side contract runs: build the Trainer the way the user's config asks, adapted to a world
of CPU ranks, run it with the trace installed, and return plain-data observations.

One run serves every contract that declares the same run kind, so a session pays for one traced
fit per (target, strategy, world) however many contracts it judges. Imported only in ranks.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from . import target as target_mod
from .trace import HOOK_PREFIXES, Recorder
from .world.rank import current_context

# Bounds that keep a conformance run small whatever the production config says.
MAX_EPOCHS = 4
DEFAULT_EPOCHS = 2
LIMIT_BATCHES = 4
FORCED = ("accelerator", "devices", "num_nodes", "logger", "enable_progress_bar", "enable_model_summary")


def _make_profiler(ns: Any, recorder: Recorder):
    base = importlib.import_module(f"{ns.__name__}.profilers").Profiler

    class TraceProfiler(base):
        """Feeds hook entries and exits to the recorder (Lightning profiles every hook)."""

        def start(self, action_name: str) -> None:
            if action_name.startswith(HOOK_PREFIXES):
                recorder.hook_enter(action_name)

        def stop(self, action_name: str) -> None:
            if action_name.startswith(HOOK_PREFIXES):
                recorder.hook_exit(action_name)

        def summary(self) -> str:
            return ""

    return TraceProfiler()


def _make_observer(ns: Any, recorder: Recorder):
    base = ns.Callback

    class Observer(base):
        """Snapshots what every rank decides: monitored values, should_stop, best checkpoints."""

        def __init__(self):
            self.snapshots: list[dict] = []

        def _snapshot(self, trainer, event: str) -> None:
            metrics = {}
            for key, value in trainer.callback_metrics.items():
                try:
                    metrics[key] = float(value)
                except Exception:
                    pass
            self.snapshots.append({"event": event, "epoch": int(trainer.current_epoch),
                                   "step": int(trainer.global_step), "metrics": metrics,
                                   "should_stop": bool(trainer.should_stop)})

        def on_validation_start(self, trainer, pl_module):
            if not trainer.sanity_checking:
                recorder.extra["validation_runs"] = recorder.extra.get("validation_runs", 0) + 1

        def on_validation_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                self._snapshot(trainer, "validation_end")

        def on_train_epoch_end(self, trainer, pl_module):
            self._snapshot(trainer, "train_epoch_end")

    return Observer()


def world_params() -> tuple[str, int]:
    """(accelerator, num_nodes) of the world this job runs in: 'cpu' or 'gpu', and how many nodes
    the ranks span, from the running job's rank context; CPU on one node outside a job."""
    ctx = current_context()
    return (ctx.accelerator, ctx.num_nodes) if ctx is not None else ("cpu", 1)


def _gpu_strategy(strategies: Any, strategy_name: str, user_strategy: Any, pg_timeout_s: float) -> Any:
    """The GPU tier runs the real strategy class with the user's own configuration: their
    instance when they gave one of that class, else the class (or their registered name)."""
    import datetime

    cls = {"fsdp": strategies.FSDPStrategy, "deepspeed": strategies.DeepSpeedStrategy}[strategy_name]
    if isinstance(user_strategy, cls):
        return user_strategy
    if isinstance(user_strategy, str) and user_strategy.lower().startswith(strategy_name):
        return user_strategy
    return cls(timeout=datetime.timedelta(seconds=pg_timeout_s))


def adapt_strategy(ns: Any, strategy_name: str, user_strategy: Any, pg_timeout_s: float,
                   accelerator: str | None = None) -> Any:
    """The strategy object a rank of our world runs for ``strategy_name``.

    'ddp': the user's DDPStrategy instance when they gave one (so find_unused_parameters and
    friends are theirs), else a DDPStrategy that keeps a string's find_unused flag; ddp_spawn
    becomes ddp, since Lightning keeps its own spawn launcher even in externally started ranks.
    """
    import datetime

    strategies = importlib.import_module(f"{ns.__name__}.strategies")
    if strategy_name == "ddp":
        if any(k.__name__ == "DeepSpeedStrategy" for k in type(user_strategy).__mro__):
            user_strategy = None  # DeepSpeed needs CUDA: a 'ddp' item runs DDP; strategy-config reads the config
        if isinstance(user_strategy, strategies.DDPStrategy):
            if getattr(user_strategy, "_start_method", "popen") != "popen":
                kwargs = dict(getattr(user_strategy, "_ddp_kwargs", {}) or {})
                return strategies.DDPStrategy(timeout=datetime.timedelta(seconds=pg_timeout_s), **kwargs)
            return user_strategy
        find_unused = isinstance(user_strategy, str) and "find_unused_parameters_true" in user_strategy
        return strategies.DDPStrategy(
            find_unused_parameters=find_unused, timeout=datetime.timedelta(seconds=pg_timeout_s)
        )
    if strategy_name in ("fsdp", "deepspeed") and (accelerator or world_params()[0]) == "gpu":
        return _gpu_strategy(strategies, strategy_name, user_strategy, pg_timeout_s)
    if strategy_name == "fsdp":
        from .sharded import cpu_fsdp_strategy

        return cpu_fsdp_strategy(ns, user_strategy, timeout_s=pg_timeout_s)
    raise ValueError(f"unknown strategy {strategy_name!r}")


def build_trainer_kwargs(user: dict, strategy: Any, world_size: int, root: str, *,
                         accelerator: str | None = None, num_nodes: int | None = None) -> dict:
    """Merge the user's Trainer kwargs with what a conformance world needs (its accelerator,
    devices per node and nodes; bounded epochs and batches, no loggers, no progress bars).

    ``accelerator`` and ``num_nodes`` default to the job's world (:func:`world_params`): CPU on
    one node for local CPU worlds, 'gpu' for the GPU tier, the launcher's nodes when attached."""
    default_accelerator, default_nodes = world_params()
    accelerator = accelerator or default_accelerator
    num_nodes = num_nodes or default_nodes
    kwargs = dict(user)
    epochs = kwargs.get("max_epochs")
    kwargs["max_epochs"] = DEFAULT_EPOCHS if epochs in (None, -1) else max(1, min(int(epochs), MAX_EPOCHS))
    kwargs.pop("max_time", None)
    if kwargs.get("max_steps", -1) not in (-1, None):
        kwargs["max_steps"] = min(int(kwargs["max_steps"]), MAX_EPOCHS * LIMIT_BATCHES)
    for stage in ("train", "val", "test", "predict"):
        key = f"limit_{stage}_batches"
        value = kwargs.get(key)
        too_many = (isinstance(value, float) and value >= 1.0) or (isinstance(value, int) and value > LIMIT_BATCHES)
        if value is None or too_many:
            kwargs[key] = LIMIT_BATCHES
    kwargs.setdefault("enable_checkpointing", False)
    kwargs.setdefault("num_sanity_val_steps", 2)
    kwargs.update(accelerator=accelerator, devices=max(1, world_size // num_nodes), num_nodes=num_nodes, logger=False,
                  enable_progress_bar=False, enable_model_summary=False, strategy=strategy,
                  default_root_dir=root)
    return kwargs


class Loaded:
    """The user's objects, loaded inside a rank after the trace is installed."""

    def __init__(self, targets: target_mod.Targets):
        self.targets = targets
        self.ns = importlib.import_module(targets.namespace)
        self.model = target_mod.instantiate(targets.model, "LightningModule", "LightningModule")
        self.datamodule = (
            target_mod.instantiate(targets.datamodule, "LightningDataModule", "LightningDataModule")
            if targets.datamodule else None
        )
        self.user_kwargs = target_mod.trainer_kwargs(targets.trainer) if targets.trainer else {}


def _float_or_none(value) -> float | None:
    try:
        return float(value)
    except Exception:
        return None


def collect_final(trainer, ns: Any) -> dict:
    """Plain-data summary of what each rank ended with: metrics, decisions, monitors."""
    callbacks_mod = importlib.import_module(f"{ns.__name__}.callbacks")
    final: dict[str, Any] = {
        "callback_metrics": {k: _float_or_none(v) for k, v in trainer.callback_metrics.items()},
        "should_stop": bool(trainer.should_stop),
        "current_epoch": int(trainer.current_epoch),
        "global_step": int(trainer.global_step),
        "checkpoints": [],
        "early_stopping": [],
        "monitors": [],
    }
    for cb in trainer.callbacks:
        if isinstance(cb, callbacks_mod.ModelCheckpoint):
            final["checkpoints"].append({
                "monitor": cb.monitor,
                "best_model_path": os.path.basename(cb.best_model_path or ""),
                "best_model_score": _float_or_none(cb.best_model_score),
                "best_k": sorted(os.path.basename(p) for p in cb.best_k_models),
            })
            if cb.monitor:
                final["monitors"].append({"key": cb.monitor, "owner": "ModelCheckpoint"})
        elif isinstance(cb, callbacks_mod.EarlyStopping):
            final["early_stopping"].append({"monitor": cb.monitor, "stopped_epoch": int(cb.stopped_epoch),
                                            "wait_count": int(cb.wait_count)})
            final["monitors"].append({"key": cb.monitor, "owner": "EarlyStopping"})
    for config in getattr(trainer, "lr_scheduler_configs", []) or []:
        if getattr(config, "monitor", None) and getattr(config, "reduce_on_plateau", False):
            final["monitors"].append({"key": config.monitor,
                                      "owner": type(config.scheduler).__name__})
    return final


def traced_fit(ctx, targets: target_mod.Targets, strategy_name: str, contract_ids: list[str],
               pg_timeout_s: float) -> dict:
    """Run ``trainer.fit`` on this rank with the trace installed; the run every fit-based
    contract is judged on. Returns plain data: final state, snapshots, per-batch metric inputs
    and each contract probe's observations."""
    from .contracts import get_contract

    recorder = Recorder(ctx.trace_path, ctx.rank)
    namespaces = [targets.namespace] + [ns for ns in target_mod.NAMESPACES
                                        if ns != targets.namespace and ns in sys.modules]
    recorder.install(tuple(namespaces))
    probes = []
    try:
        loaded = Loaded(targets)
        ns = loaded.ns
        for cid in contract_ids:
            probe = get_contract(cid).probe()
            if probe is not None:
                probes.append((cid, probe))
        strategy = adapt_strategy(ns, strategy_name, loaded.user_kwargs.get("strategy"), pg_timeout_s)
        from .sharded import ddp_note

        # What ran in place of the user's strategy (their FSDP/DeepSpeed config as CPU FSDP, or as DDP).
        note = getattr(strategy, "ltconform_note", None) or ddp_note(strategy_name, loaded.user_kwargs.get("strategy"))
        if note:
            recorder.emit({"ev": "note", "text": note})
        kwargs = build_trainer_kwargs(loaded.user_kwargs, strategy, ctx.world_size, ctx.job_dir)
        observer = _make_observer(ns, recorder)
        kwargs["callbacks"] = list(kwargs.get("callbacks") or []) + [observer]
        if kwargs.get("profiler") is None:
            kwargs["profiler"] = _make_profiler(ns, recorder)
        for _, probe in probes:
            probe.before_trainer(loaded, kwargs, recorder)
        trainer = ns.Trainer(**kwargs)
        recorder.attach(trainer)
        for _, probe in probes:
            probe.before_fit(loaded, trainer, recorder)
        recorder.emit({"ev": "stage", "name": "fit"})
        trainer.fit(loaded.model, datamodule=loaded.datamodule)
        for _, probe in probes:
            probe.after_fit(loaded, trainer, recorder)
        result = {
            "final": collect_final(trainer, ns),
            "snapshots": observer.snapshots,
            "per_batch": recorder.per_batch_logs,
            "probes": {cid: probe.collect(loaded, trainer, recorder) for cid, probe in probes},
        }
        return result
    finally:
        recorder.uninstall()
