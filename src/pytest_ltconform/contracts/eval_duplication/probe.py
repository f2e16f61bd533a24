"""Rank side of eval-duplication: its evaluation run, its one-rank reference and its probe.

``evaluate`` runs on every rank of the world: the driver steps (``fit`` unless the target's
module says otherwise in ``PLAIN_DRIVER``), then each evaluation stage (validate, test, predict)
the target has a dataloader for, on the same Trainer. For every stage it records, per rank, the
dataset keys each fetch of the stage's loop received (read at source, where the DataLoader iterator
draws them from its sampler, never from the batches nor by iterating the sampler again), how many samples
each TorchMetrics object was updated with, the metrics the stage returned, and the files user
code opened for writing. Rank 0 saves the weights the stages ran with.

``reference`` runs in a world of one rank: a ``Trainer(accelerator="cpu", devices=1)`` on
those weights and the same data and stages, for the single-device values.

Imported only in ranks.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ...events import STAGE, Recorded, declare
from ...harness import RankRun, UserObjects, batch_leaves, can_run, rank_run, tolerate_unused_parameters
from ...runs import Probe, RunArgs
from ...sites import user_site
from .. import fetches, loader_sites


class EvalStageEvent(Recorded):
    """An evaluation stage (``name``: validate, test, predict) began or ended (``at``: 'start', 'end')."""

    name: str
    at: str


EVAL_STAGE = declare("eval_stage", EvalStageEvent)

STAGES = ("validate", "test", "predict")
_LOADER = {"validate": "val_dataloader", "test": "test_dataloader", "predict": "predict_dataloader"}
_TRAINER_LOADERS = {"validate": "val_dataloaders", "test": "test_dataloaders", "predict": "predict_dataloaders"}
_MAX_INDICES = 100_000
_MAX_CONTENT_BATCHES = 2_000  # batches per loader whose content is fingerprinted

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
        _ACTIVE["writes"].append({"path": rel, "abs": full, "stage": _ACTIVE["stage"], "site": site,
                                  "after_batch": _ACTIVE.get("first_batch_at") is not None})
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


def _facts(loader) -> dict:
    """What decides the samples ``loader`` hands this rank: its dataset, sampler and sizes. The
    indices themselves are read at source while the stage runs (:class:`_Fetches`), never by
    iterating the sampler again (a sampler with state or its own RNG would hand out others)."""
    info: dict[str, Any] = {"sampler": None, "indices": None, "dataset_len": None}
    dataset = getattr(loader, "dataset", None)
    info["dataset"] = type(dataset).__qualname__ if dataset is not None else type(loader).__qualname__
    info["loader"] = type(loader).__qualname__
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
    from torch.utils.data import DataLoader, IterableDataset

    if isinstance(dataset, IterableDataset):
        info["iterable"] = True
    info["map_loader"] = isinstance(loader, DataLoader) and not info.get("iterable")
    return info


def _keys(index) -> list:
    """The dataset keys one fetch hands ``__getitem__``/``__getitems__``: one key, or the list a
    batch sampler yields."""
    out = []
    for k in index if isinstance(index, (list, tuple)) else [index]:
        try:
            out.append(int(k))
        except (TypeError, ValueError):
            out.append(repr(k)[:60])  # a key that is not an integer still names one sample
    return out


class _Fetches:
    """Rank side: the keys each fetch of a map-style dataset receives during an evaluation
    stage, per loader, read where the DataLoader iterator draws them from its sampler (in the
    main process, whatever the workers), so it is what the loop really evaluated."""

    def __init__(self, state: dict):
        self.state = state

    def install(self, recorder) -> None:
        fetches.tap(recorder, self.record)

    def record(self, it, index) -> None:
        # Keyed by the loader's index sampler: workers prefetch before the stage's start hook
        # says which loaders the stage has.
        state = self.state
        if not state.get("stage") or getattr(it, "_dataset_kind", 0) != 0 or index is None:
            return  # outside an evaluation stage, or an iterable dataset (no keys)
        groups = state["fetched"].setdefault(id(getattr(it, "_index_sampler", None)), [])
        if len(groups) < _MAX_INDICES:
            groups.append(_keys(index))


def _fetched(state: dict) -> None:
    """Give each loader of the stage the keys its fetches received, cut to the batches the loop
    really ran (workers prefetch past a user's limit_*_batches)."""
    for i, info in enumerate(state["record"].get("loaders") or []):
        source = info.pop("source", None)
        if not info.get("map_loader") or not state.get("reading"):
            continue
        groups = state["fetched"].get(source, [])[:state["ran"].get(i, 0)]
        info["indices"] = [k for g in groups for k in g]
        info["batches"] = len(groups)


def _make_callback(ns: Any, probe: EvalDuplicationProbe):
    class EvalObserver(ns.Callback):
        """Reads each evaluation stage's samplers and counts what TorchMetrics objects receive."""

        def on_validation_start(self, trainer, pl_module):
            if not trainer.sanity_checking:
                probe.stage_start(trainer, "validate")

        def on_test_start(self, trainer, pl_module):
            probe.stage_start(trainer, "test")

        def on_predict_start(self, trainer, pl_module):
            probe.stage_start(trainer, "predict")

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            if not trainer.sanity_checking:
                probe.batch_ran(dataloader_idx)
                probe.batch_seen("validate", batch, dataloader_idx)

        def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            probe.batch_ran(dataloader_idx)
            probe.batch_seen("test", batch, dataloader_idx)

        def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            probe.batch_ran(dataloader_idx)
            probe.batch_seen("predict", batch, dataloader_idx)

        def on_validation_epoch_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                probe.stage_end("validate")

        def on_test_epoch_end(self, trainer, pl_module):
            probe.stage_end("test")

        def on_predict_epoch_end(self, trainer, pl_module):
            probe.stage_end("predict")

    return EvalObserver()


class EvalDuplicationProbe(Probe):
    """Per evaluation stage: the indices each loader hands this rank, the samples each TorchMetrics
    object is updated with, the files user code writes and where its step hooks read the rank
    (``rank_reads``, see :mod:`..rank_reads`). ``load_from`` (a state dict) loads the
    world's weights into the one-rank reference."""

    def __init__(self, load_from: dict | None = None):
        self.state: dict[str, Any] = {"stage": None, "record": {}, "metrics": {}, "load_from": load_from,
                                      "fetched": {}, "ran": {}}
        self.root = "."

    def install(self, recorder) -> None:
        loader_sites.install(recorder)
        _Fetches(self.state).install(recorder)
        self.state["reading"] = True

    def before_trainer(self, objects, trainer_kwargs, recorder) -> None:
        self.root = trainer_kwargs["default_root_dir"]
        self.user_kwargs = objects.user_kwargs  # the production world size a stage's split is replayed at
        trainer_kwargs["callbacks"] = list(trainer_kwargs.get("callbacks") or []) + \
            [_make_callback(objects.ns, self)]
        if recorder is not None:
            from ..rank_reads import RankReads, step_hook

            # Only reads inside an evaluation stage's steps count (fit's validation loop is not one).
            RankReads(self._rank_read, lambda: step_hook(recorder.trainer) if self.state.get("stage") else None) \
                .install(objects.ns, recorder)

    def _rank_read(self, event: dict) -> None:
        self.state["record"].setdefault("rank_reads", []).append(event)

    def before_fit(self, objects, trainer, recorder) -> None:
        _count_metric_updates(objects.model, self.state)
        _install_audit(self.root)

    def stage_start(self, trainer, stage: str) -> None:
        state = self.state
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
        loaders = _loaders(getattr(trainer, _TRAINER_LOADERS[stage], None))
        state["record"]["loaders"] = [{**_facts(dl), "built": loader_sites.loader_of(_LOADER[stage], i),
                                       "source": id(getattr(dl, "_index_sampler", None))}
                                      for i, dl in enumerate(loaders)]
        if loaders and trainer.global_rank == 0:
            from .. import production

            try:  # every rank of the production world, computed from this rank's sampler
                state["record"]["production"] = production.plan(loaders[0], getattr(self, "user_kwargs", {}),
                                                                trainer.world_size)
            except Exception as exc:
                state["record"]["production"] = {"world": 0, "not_computed": f"{type(exc).__name__}: {exc}"}
        for counter in state["metrics"].values():
            counter["n"] = 0

    def batch_ran(self, dataloader_idx: int) -> None:
        if _ACTIVE.get("stage") and _ACTIVE.get("first_batch_at") is None:
            import time

            _ACTIVE["first_batch_at"] = time.time()  # what is written from here on may hold outputs
        if self.state.get("stage"):
            self.state["ran"][dataloader_idx] = self.state["ran"].get(dataloader_idx, 0) + 1

    def batch_seen(self, stage: str, batch, dataloader_idx: int) -> None:
        """Fingerprints the content of a batch the stage's loop received, for loaders that hand out
        no dataset indices (iterables, loaders without a sampler)."""
        if self.state.get("stage") != stage:
            return
        infos = self.state["record"].get("loaders") or []
        info = infos[dataloader_idx] if dataloader_idx < len(infos) else {}
        if info.get("map_loader") and self.state.get("reading"):
            return  # its indices are read at the source (_fetched)
        seen = self.state["record"].setdefault("contents", {}).setdefault(str(dataloader_idx), [])
        if len(seen) < _MAX_CONTENT_BATCHES:
            seen.append(content_fingerprint(batch))

    def stage_end(self, stage: str) -> None:
        state = self.state
        if state.get("stage") != stage:
            return
        _fetched(state)
        state["record"]["metric_samples"] = {name: {"type": c["type"], "n": c["n"]}
                                             for name, c in state["metrics"].items()}


def content_fingerprint(batch) -> dict | None:
    """A batch's content: a hash of every leaf (``fp``) and, per tensor leaf, its hash, element
    count and whether it is floating point (``leaves``), so that a leaf that identifies samples (a
    feature tensor) can be compared across ranks apart from one drawn at random per rank (negative
    samples). None for a batch without tensors."""
    import hashlib

    import torch

    leaves: list = []
    batch_leaves(batch, leaves)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    if not tensors:
        return None
    whole = hashlib.blake2b(digest_size=8)
    out = []
    for t in leaves:
        if not isinstance(t, torch.Tensor):
            whole.update(repr(t).encode()[:1000])
            continue
        flat = t.detach().cpu().contiguous().reshape(-1)
        if flat.dtype == torch.bfloat16 or flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat.float()
        data = flat.numpy().tobytes() if flat.numel() <= 1_000_000 else repr(tuple(t.shape)).encode()
        digest = hashlib.blake2b(data + repr(tuple(t.shape)).encode(), digest_size=8).hexdigest()
        whole.update(digest.encode())
        out.append([digest, int(t.numel()), bool(t.is_floating_point())])
    return {"fp": whole.hexdigest(), "leaves": out}


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


def _has_loader(loaded: UserObjects, stage: str) -> bool:
    """Whether ``stage`` can run: a dataloader for it and the step method it calls."""
    return can_run(loaded, _LOADER[stage], _STEP[stage])


def _driver(loaded: UserObjects) -> tuple[list[str], list[str]]:
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


def _eval_kwargs(run: RankRun, user: dict, strategy: Any, world_size: int) -> tuple[dict, dict, bool]:
    """Trainer kwargs for an evaluation run (bounded as every conformance run), and the limits the
    evaluation stages run with: whole epochs (a cap would make worlds of different sizes see
    different samples) unless the user set limits, in which case ``limited`` is True."""
    kwargs = run.trainer_kwargs(strategy, user, world_size)
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


def _stage_writes() -> list[dict]:
    """The files user code wrote in the stage that just ended, once each, with their line counts.
    ``outputs``: whether the file was opened or last changed once the stage's first batch had
    started (a file that setup() wrote and nothing touched after holds none of the stage's outputs)."""
    writes: list[dict] = []
    first = _ACTIVE.get("first_batch_at")
    for w in _ACTIVE["writes"]:
        known = next((x for x in writes if x["path"] == w["path"]), None)
        if known is not None:
            known["after_batch"] = known["after_batch"] or w["after_batch"]
            continue
        try:
            with open(w["abs"], "rb") as fh:
                w["lines"] = sum(1 for _ in fh) if os.path.getsize(w["abs"]) < 50_000_000 else None
            changed = os.path.getmtime(w["abs"])
        except OSError:
            w["lines"], changed = None, None
        w["changed_after_batch"] = first is not None and changed is not None and changed > first
        writes.append(w)
    for w in writes:
        w["outputs"] = bool(w.pop("after_batch") or w.pop("changed_after_batch"))
        w.pop("changed_after_batch", None)
    return writes


def _run_stage(run: RankRun, stage: str, state: dict) -> dict:
    """One evaluation stage on this rank, recorded; an exception the stage raises is recorded as
    the stage's ``error`` (type, first line, the user's frame) instead of ending the run."""
    import traceback

    trainer, objects = run.trainer, run.objects
    record = state["record"] = {"loaders": [], "metric_samples": {}}
    state.update(stage=stage, fetched={}, ran={})
    _ACTIVE.update(stage=stage, writes=[], first_batch_at=None)
    run.emit({"ev": EVAL_STAGE, "name": stage, "at": "start"})
    out = None
    try:
        out = getattr(trainer, stage)(objects.model, datamodule=objects.datamodule)
    except Exception as exc:
        record["error"] = {"exc_type": type(exc).__name__, "message": str(exc)[:2000],
                           "traceback": traceback.format_exc()[-6000:]}
    finally:
        _ACTIVE["stage"] = None
        state["stage"] = None
        run.emit({"ev": EVAL_STAGE, "name": stage, "at": "end"})
    if stage == "predict":
        batches = _loaders(out) if out is not None else []
        record["returned_batches"] = len(batches)
    else:
        record["returned"] = [_floats(d) for d in (out or [])]
    record["callback_metrics"] = _floats(trainer.callback_metrics)
    record["writes"] = _stage_writes()
    return record


def _all_ranks_ok(failed: bool) -> bool:
    """True when no rank's stage raised: the ranks agree before starting the next stage, so that
    a rank whose stage raised never leaves the others waiting inside the next one."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return not failed
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([1.0 if failed else 0.0], device=device)
    dist.all_reduce(flag)
    return flag.item() == 0.0


def _run_stages(run: RankRun, stages: list[str], state: dict) -> dict:
    """Every stage in order, recorded; stops after the first stage that raised on any rank,
    keeping what the stages before it recorded."""
    results = {}
    for stage in stages:
        results[stage] = _run_stage(run, stage, state)
        if not _all_ranks_ok("error" in results[stage]):
            break
    return results


def _probe_of(run: RankRun) -> EvalDuplicationProbe:
    return next(p for p in run.probes.values() if isinstance(p, EvalDuplicationProbe))


def evaluate(ctx, args: RunArgs) -> dict:
    """Every rank: the driver steps, then each evaluation stage under ``args.strategy``, recorded.
    Returns plain data:
    ``{"eval": {"stages": {stage: record}, "weights": path, "driver": [...], "limited": bool},
    "reference_args": [weights, stages] (rank 0)}``."""
    try:
        with rank_run(ctx, args) as run:
            probe = _probe_of(run)
            objects = run.objects
            before, stages = _driver(objects)
            strategy = run.strategy(args.strategy, objects.user_kwargs.get("strategy"))
            # Unused parameters are unused-parameters' verdict; the evaluation must still run.
            tolerate_unused_parameters(strategy)
            kwargs, limits, limited = _eval_kwargs(run, objects.user_kwargs, strategy, ctx.world_size)
            trainer = run.build_trainer(kwargs)
            if "fit" in before:
                run.emit({"ev": STAGE, "name": "fit"})
                trainer.fit(objects.model, datamodule=objects.datamodule)
            weights = os.path.join(os.path.dirname(ctx.job_dir), "eval_weights.pt")
            if ctx.rank == 0:
                probe.state["save_to"] = weights
            _set_limits(trainer, limits)
            results = _run_stages(run, stages, probe.state)
            return {"eval": {"stages": results, "weights": weights, "driver": before + stages, "limited": limited,
                             "world_size": ctx.world_size},
                    "reference_args": [weights, stages] if ctx.rank == 0 else None}
    finally:
        _ACTIVE["stage"] = None


def reference(ctx, args: RunArgs, weights: str, stages: list[str]) -> dict:
    """One rank, ``Trainer(accelerator="cpu", devices=1)``: the same stages on the saved weights."""
    import torch

    probe = EvalDuplicationProbe(load_from=torch.load(weights, map_location="cpu", weights_only=True))
    try:
        with rank_run(ctx, args, traced=False, probes=[("reference", probe)]) as run:
            user = {k: v for k, v in run.objects.user_kwargs.items() if k != "strategy"}
            kwargs, limits, limited = _eval_kwargs(run, user, "auto", 1)
            trainer = run.build_trainer(kwargs)
            _set_limits(trainer, limits)
            results = _run_stages(run, stages, probe.state)
    finally:
        _ACTIVE["stage"] = None
    return {"eval": {"stages": results, "limited": limited, "world_size": 1,
                     "load_problems": probe.state.get("load_problems", [])}}
