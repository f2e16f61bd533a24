"""Rank-side evaluation runs for the eval-duplication contract.

``traced_eval`` runs on every rank of the world: the driver steps (``fit`` unless the target's
module says otherwise in ``PLAIN_DRIVER``), then each evaluation stage (validate, test, predict)
the target has a dataloader for, on the same Trainer. For every stage it records, per rank, the
dataset indices the loader's sampler hands that rank (read from the sampler Lightning injected or
the user's own, never from the batches, so the dataset need not return ids), how many samples
each TorchMetrics object was updated with, the metrics the stage returned, and the files user
code opened for writing. Rank 0 saves the weights the stages ran with.

``reference_eval`` runs in a world of one rank: a ``Trainer(accelerator="cpu", devices=1)`` on
those weights and the same data and stages, for the single-device values.

Imported only in ranks.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from . import target as target_mod
from .runs import Loaded, _make_profiler, adapt_strategy, build_trainer_kwargs
from .sites import user_site
from .trace import Recorder

STAGES = ("validate", "test", "predict")
_LOADER = {"validate": "val_dataloader", "test": "test_dataloader", "predict": "predict_dataloader"}
_TRAINER_LOADERS = {"validate": ("val_dataloaders", "num_val_batches"),
                    "test": ("test_dataloaders", "num_test_batches"),
                    "predict": ("predict_dataloaders", "num_predict_batches")}
_MAX_INDICES = 100_000

# The audit hook cannot be removed once added: it is installed once per process and only records
# while a stage of a traced evaluation is active.
_ACTIVE: dict[str, Any] = {}
_HOOKED = False


def _audit(event: str, args) -> None:
    if event != "open" or not _ACTIVE.get("stage"):
        return
    try:
        path, mode, flags = args
        if mode is not None:
            writes = any(c in str(mode) for c in "wax+")
        else:
            writes = bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND))
        if not writes or not isinstance(path, (str, bytes, os.PathLike)):
            return
        site, _ = user_site(2)
        if site is None:
            return
        path = os.fsdecode(path)
        root = _ACTIVE["root"]
        full = os.path.abspath(path)
        rel = os.path.relpath(full, root) if full.startswith(root + os.sep) else full
        _ACTIVE["writes"].append({"path": rel, "abs": full, "stage": _ACTIVE["stage"], "site": site})
    except Exception:
        pass


def _install_audit(root: str) -> None:
    global _HOOKED
    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED = True
    _ACTIVE.update(stage=None, root=os.path.abspath(root), writes=[])


def _loaders(value) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, dict):
        return list(value.values())
    return [value]


def _indices(loader, num_batches) -> dict:
    """The dataset indices ``loader`` hands this rank in one pass of ``num_batches`` batches."""
    info: dict[str, Any] = {"sampler": None, "indices": None, "dataset_len": None}
    dataset = getattr(loader, "dataset", None)
    try:
        info["dataset_len"] = len(dataset)
    except Exception:
        pass
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    # Lightning's predict wrapper iterates as itself (one shared iterator): read the one it wraps.
    batch_sampler = getattr(batch_sampler, "_batch_sampler", batch_sampler)
    inner = getattr(batch_sampler, "sampler", None) if batch_sampler is not None else sampler
    info["sampler"] = type(inner).__name__ if inner is not None else None
    for attr in ("num_samples", "total_size", "drop_last", "shuffle"):
        if hasattr(inner, attr):
            try:
                info[attr] = getattr(inner, attr) if attr in ("drop_last", "shuffle") else int(getattr(inner, attr))
            except Exception:
                pass
    from torch.utils.data import IterableDataset

    if isinstance(dataset, IterableDataset):
        info["iterable"] = True
        return info
    limit = None if num_batches is None or num_batches == float("inf") else int(num_batches)
    out: list[int] = []
    try:
        if batch_sampler is not None:
            for b, batch in enumerate(batch_sampler):
                if limit is not None and b >= limit:
                    break
                out.extend(int(i) for i in batch)
                if len(out) > _MAX_INDICES:
                    break
        elif sampler is not None:
            for k, i in enumerate(sampler):
                if limit is not None and k >= limit:
                    break
                out.append(int(i))
                if len(out) > _MAX_INDICES:
                    break
        else:
            return info
    except Exception as exc:  # a sampler yielding non-integer keys
        info["error"] = f"{type(exc).__name__}: {exc}"
        return info
    info["indices"] = out
    return info


def _make_callback(ns: Any, state: dict):
    class EvalObserver(ns.Callback):
        """Reads each evaluation stage's samplers and counts what TorchMetrics objects receive."""

        def _start(self, trainer, stage):
            if state.get("stage") != stage:
                return
            # Weights move here, after configure_model has built every layer.
            if state.get("save_to") and not state.get("saved"):
                import torch

                torch.save({k: v.detach().cpu() for k, v in trainer.lightning_module.state_dict().items()},
                           state["save_to"])
                state["saved"] = True
            if state.get("load_from") is not None:
                result = trainer.lightning_module.load_state_dict(state["load_from"], strict=False)
                state["load_problems"] = sorted(set(result.missing_keys) | set(result.unexpected_keys))
            attr, num_attr = _TRAINER_LOADERS[stage]
            loaders = _loaders(getattr(trainer, attr, None))
            nums = list(getattr(trainer, num_attr, None) or [])
            state["record"]["loaders"] = [_indices(dl, nums[i] if i < len(nums) else None)
                                          for i, dl in enumerate(loaders)]
            for counter in state["metrics"].values():
                counter["n"] = 0

        def _end(self, trainer, stage):
            if state.get("stage") != stage:
                return
            state["record"]["metric_samples"] = {name: {"type": c["type"], "n": c["n"]}
                                                 for name, c in state["metrics"].items()}

        def on_validation_start(self, trainer, pl_module):
            if not trainer.sanity_checking:
                self._start(trainer, "validate")

        def on_test_start(self, trainer, pl_module):
            self._start(trainer, "test")

        def on_predict_start(self, trainer, pl_module):
            self._start(trainer, "predict")

        def on_validation_epoch_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                self._end(trainer, "validate")

        def on_test_epoch_end(self, trainer, pl_module):
            self._end(trainer, "test")

        def on_predict_epoch_end(self, trainer, pl_module):
            self._end(trainer, "predict")

    return EvalObserver()


def _count_metric_updates(model, state: dict) -> None:
    """Wrap each TorchMetrics object's ``update`` to count the samples it receives."""
    try:
        from torchmetrics import Metric
    except ImportError:
        return
    import torch

    for name, mod in model.named_modules():
        if not isinstance(mod, Metric) or not name:
            continue
        counter = state["metrics"][name] = {"type": type(mod).__name__, "n": 0}
        original = mod.update

        def update(*args, _orig=original, _c=counter, **kwargs):
            first = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
            _c["n"] += int(first.shape[0]) if first is not None and first.dim() > 0 else 1
            return _orig(*args, **kwargs)

        mod.update = update


_STEP = {"validate": ("validation_step",), "test": ("test_step",), "predict": ("predict_step", "forward")}


def _has_loader(loaded: Loaded, stage: str) -> bool:
    """Whether ``stage`` can run: a dataloader for it and the step method it calls."""
    attr = _LOADER[stage]
    ns = loaded.ns
    model = type(loaded.model)
    module_has = getattr(model, attr, None) is not getattr(ns.LightningModule, attr)
    dm = loaded.datamodule
    dm_has = dm is not None and getattr(type(dm), attr, None) is not getattr(ns.LightningDataModule, attr)
    step = any(getattr(model, name, None) is not getattr(ns.LightningModule, name, None) for name in _STEP[stage])
    return (module_has or dm_has) and step


def _driver(loaded: Loaded) -> tuple[list[str], list[str]]:
    """(steps before evaluation, evaluation stages). A target's module may name its own driver in
    ``PLAIN_DRIVER`` ("fit", "fit,validate", "validate", "predict"); otherwise fit, then every
    evaluation stage the target has a dataloader for."""
    module = sys.modules.get(type(loaded.model).__module__)
    spec = getattr(module, "PLAIN_DRIVER", None)
    steps = [s.strip() for s in str(spec).split(",") if s.strip()] if isinstance(spec, str) else ["fit"]
    before = [s for s in steps if s == "fit"]
    stages = [s for s in steps if s in STAGES]
    if not stages:
        stages = [s for s in STAGES if _has_loader(loaded, s)]
    return before, stages


def _eval_kwargs(user: dict, strategy: Any, world_size: int, root: str) -> tuple[dict, dict, bool]:
    """Trainer kwargs for an evaluation run (bounded as every conformance run), and the limits the
    evaluation stages run with: whole epochs (a cap would make worlds of different sizes see
    different samples) unless the user set limits, in which case ``limited`` is True."""
    kwargs = build_trainer_kwargs(user, strategy, world_size, root)
    limits = {}
    limited = False
    for stage in ("val", "test", "predict"):
        key = f"limit_{stage}_batches"
        if user.get(key) is None or (isinstance(user.get(key), float) and user[key] >= 1.0):
            limits[key] = 1.0
        else:
            limits[key] = user[key]
            limited = True
    return kwargs, limits, limited


def _set_limits(trainer, limits: dict) -> None:
    # The loops read these when each stage sets up its data, so the bounded fit keeps its caps.
    for key, value in limits.items():
        setattr(trainer, key, value)


def _floats(metrics) -> dict:
    out = {}
    for key, value in (metrics or {}).items():
        try:
            out[str(key)] = float(value)
        except Exception:
            pass
    return out


def _run_stages(trainer, loaded: Loaded, stages: list[str], state: dict, recorder: Recorder | None) -> dict:
    results = {}
    for stage in stages:
        record = state["record"] = {"loaders": [], "metric_samples": {}}
        state["stage"] = stage
        _ACTIVE.update(stage=stage, writes=[])
        if recorder is not None:
            recorder.emit({"ev": "eval_stage", "name": stage, "at": "start"})
        try:
            out = getattr(trainer, stage)(loaded.model, datamodule=loaded.datamodule)
        finally:
            _ACTIVE["stage"] = None
            state["stage"] = None
            if recorder is not None:
                recorder.emit({"ev": "eval_stage", "name": stage, "at": "end"})
        if stage == "predict":
            batches = _loaders(out) if out is not None else []
            record["returned_batches"] = len(batches)
        else:
            record["returned"] = [_floats(d) for d in (out or [])]
        record["callback_metrics"] = _floats(trainer.callback_metrics)
        writes = []
        for w in _ACTIVE["writes"]:
            if any(x["path"] == w["path"] for x in writes):
                continue
            try:
                with open(w["abs"], "rb") as fh:
                    w["lines"] = sum(1 for _ in fh) if os.path.getsize(w["abs"]) < 50_000_000 else None
            except OSError:
                w["lines"] = None
            writes.append(w)
        record["writes"] = writes
        results[stage] = record
    return results


def traced_eval(ctx, targets: target_mod.Targets, strategy_name: str, contract_ids: list[str],
                pg_timeout_s: float) -> dict:
    """Every rank: the driver steps, then each evaluation stage, recorded. Returns plain data:
    ``{"eval": {"stages": {stage: record}, "weights": path, "driver": [...], "limited": bool}}``."""
    recorder = Recorder(ctx.trace_path, ctx.rank)
    namespaces = [targets.namespace] + [ns for ns in target_mod.NAMESPACES
                                        if ns != targets.namespace and ns in sys.modules]
    recorder.install(tuple(namespaces))
    try:
        loaded = Loaded(targets)
        ns = loaded.ns
        before, stages = _driver(loaded)
        strategy = adapt_strategy(ns, strategy_name, loaded.user_kwargs.get("strategy"), pg_timeout_s)
        kwargs, limits, limited = _eval_kwargs(loaded.user_kwargs, strategy, ctx.world_size, ctx.job_dir)
        state: dict[str, Any] = {"stage": None, "record": {}, "metrics": {}}
        kwargs["callbacks"] = list(kwargs.get("callbacks") or []) + [_make_callback(ns, state)]
        if kwargs.get("profiler") is None:
            kwargs["profiler"] = _make_profiler(ns, recorder)
        trainer = ns.Trainer(**kwargs)
        recorder.attach(trainer)
        _count_metric_updates(loaded.model, state)
        _install_audit(ctx.job_dir)
        if "fit" in before:
            recorder.emit({"ev": "stage", "name": "fit"})
            trainer.fit(loaded.model, datamodule=loaded.datamodule)
        weights = os.path.join(os.path.dirname(ctx.job_dir), "eval_weights.pt")
        if ctx.rank == 0:
            state["save_to"] = weights
        _set_limits(trainer, limits)
        results = _run_stages(trainer, loaded, stages, state, recorder)
        return {"eval": {"stages": results, "weights": weights, "driver": before + stages, "limited": limited,
                         "world_size": ctx.world_size},
                "reference_args": [weights, stages] if ctx.rank == 0 else None}
    finally:
        _ACTIVE["stage"] = None
        recorder.uninstall()


def reference_eval(ctx, targets: target_mod.Targets, weights: str, stages: list[str], pg_timeout_s: float) -> dict:
    """One rank, ``Trainer(accelerator="cpu", devices=1)``: the same stages on the saved weights."""
    import torch

    loaded = Loaded(targets)
    ns = loaded.ns
    user = {k: v for k, v in loaded.user_kwargs.items() if k != "strategy"}
    kwargs, limits, limited = _eval_kwargs(user, "auto", 1, ctx.job_dir)
    state: dict[str, Any] = {"stage": None, "record": {}, "metrics": {},
                             "load_from": torch.load(weights, map_location="cpu", weights_only=True)}
    kwargs["callbacks"] = list(kwargs.get("callbacks") or []) + [_make_callback(ns, state)]
    trainer = ns.Trainer(**kwargs)
    _set_limits(trainer, limits)
    _count_metric_updates(loaded.model, state)
    _install_audit(ctx.job_dir)
    try:
        results = _run_stages(trainer, loaded, stages, state, None)
    finally:
        _ACTIVE["stage"] = None
    return {"eval": {"stages": results, "limited": limited, "world_size": 1,
                     "load_problems": state.get("load_problems", [])}}
