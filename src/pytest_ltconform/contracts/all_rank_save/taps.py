"""Rank side of all-rank-save: library calls that make collectives on behalf of user code.

Raw collectives, saves and strategy calls are traced by the generic recorder, but a library often
makes its collectives below a call that does not look like one. Each tap here traces such a call
as one collective-bearing ``call`` event (:meth:`Recorder.call`) at the user's own call site, so
that a call made on a subset of ranks is blamed at the user's line, and the collectives the
library makes inside are nested under it (``user`` False):

- ``Metric.compute()`` / ``sync()`` / ``forward`` of TorchMetrics, only when the metric really
  syncs (its ``_sync_dist`` runs: sync enabled, distributed, a process group of 2+ ranks);
- ``DistributedDataParallel.forward`` called by user code (``trainer.model(x)``) when it
  broadcasts buffers (``broadcast_buffers=True`` and the module has buffers); Lightning's own
  training/validation steps call it on every rank and are not traced;
- Lightning's ``ModelCheckpoint`` hooks and save methods called by user code (they reduce the
  "should save" decision across ranks and save through ``Trainer.save_checkpoint``).
"""

from __future__ import annotations

import sys

from ...sites import is_user_file

# ModelCheckpoint methods that reach collectives (reduce_boolean_decision, save_checkpoint).
CHECKPOINT_METHODS = ("on_train_batch_end", "on_train_epoch_end", "on_validation_end", "on_train_end",
                      "_save_topk_checkpoint", "_save_checkpoint", "_save_last_checkpoint",
                      "_save_monitor_checkpoint", "_save_none_monitor_checkpoint")
# The name a metric's entry frame gives the user's call.
_METRIC_ENTRY = {"wrapped_func": "compute", "_wrapped_call_impl": "forward", "_call_impl": "forward"}


def call_site(frame, through: tuple[str, ...]) -> tuple[dict | None, bool, object]:
    """``(site, direct, entry)`` for a call whose innermost frame is ``frame``: the first user
    frame above it, whether only frames of the modules ``through`` (name prefixes) lie between
    (user code made the call itself), and the outermost of those frames that belongs to
    ``through[0]`` (the library entry point the user called; None when there is none)."""
    direct, entry = True, None
    while frame is not None:
        code = frame.f_code
        if is_user_file(code.co_filename):
            site = {"file": code.co_filename, "line": frame.f_lineno,
                    "func": getattr(code, "co_qualname", code.co_name)}
            return site, direct, entry
        module = frame.f_globals.get("__name__", "") or ""
        if not module.startswith(through):
            direct = False
        elif direct and through and module.startswith(through[0]):
            entry = frame
        frame = frame.f_back
    return None, False, entry


def _syncs_across_ranks(metric, args, kwargs) -> bool:
    """Whether this ``_sync_dist`` exchanges state with other ranks (a group of 2+ ranks)."""
    try:
        import torch.distributed as dist

        group = kwargs.get("process_group") or (args[1] if len(args) > 1 else None) or \
            getattr(metric, "process_group", None)
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    except Exception:  # a group this rank is not part of, or no default group
        return False


def metric_sync_tap(recorder):
    """Wrapper factory for ``torchmetrics.Metric._sync_dist``."""

    def factory(original):
        def _sync_dist(metric, *args, **kwargs):
            if not _syncs_across_ranks(metric, args, kwargs):
                return original(metric, *args, **kwargs)
            site, direct, entry = call_site(sys._getframe(1), ("torchmetrics", "torch.nn.modules", "contextlib"))
            owner, op = metric, "compute"
            if entry is not None:
                name = entry.f_code.co_name
                op = _METRIC_ENTRY.get(name, name)
                this = entry.f_locals.get("self")
                owner = this if this is not None and not isinstance(this, type) else metric
            label = f"{type(owner).__name__}.{op}"
            with recorder.call("metric", "metric_sync", label, site, direct, metric=type(metric).__name__,
                               effect="all-gathers the metric state"):
                return original(metric, *args, **kwargs)

        return _sync_dist

    return factory


def _broadcasts_buffers(ddp) -> bool:
    try:
        check = getattr(ddp, "_check_sync_bufs_pre_fwd", None) or ddp.will_sync_module_buffers
        return bool(check())
    except Exception:  # an older or half-initialised wrapper
        return False


def ddp_forward_tap(recorder):
    """Wrapper factory for ``DistributedDataParallel.forward``: traced only when user code calls
    the wrapper itself and the forward broadcasts buffers."""

    def factory(original):
        def forward(ddp, *args, **kwargs):
            if not _broadcasts_buffers(ddp):
                return original(ddp, *args, **kwargs)
            site, direct, _ = call_site(sys._getframe(1), ("torch.nn.modules",))
            if not direct:  # Lightning's own steps: the same on every rank
                return original(ddp, *args, **kwargs)
            with recorder.call("ddp", "ddp_forward", "DistributedDataParallel.forward", site, direct,
                               effect="broadcasts buffers"):
                return original(ddp, *args, **kwargs)

        return forward

    return factory


def checkpoint_tap(recorder, name: str):
    """Wrapper factory for a ``ModelCheckpoint`` method: traced only when user code calls it."""

    def factory(original):
        def method(callback, *args, **kwargs):
            site, direct, _ = call_site(sys._getframe(1), ())
            if not direct:  # Lightning's loop calls it on every rank
                return original(callback, *args, **kwargs)
            label = f"{type(callback).__name__}.{name}"
            with recorder.call("save", name, label, site, direct,
                               effect="reduces the save decision across ranks and saves"):
                return original(callback, *args, **kwargs)

        return method

    return factory


def install(recorder) -> None:
    """Patch the library calls above (called before the user's module is imported)."""
    try:
        import torchmetrics

        recorder.patch(torchmetrics.Metric, "_sync_dist", metric_sync_tap(recorder))
    except ImportError:
        pass
    from torch.nn.parallel import DistributedDataParallel

    recorder.patch(DistributedDataParallel, "forward", ddp_forward_tap(recorder))
    for ns in ("lightning.pytorch", "pytorch_lightning"):
        if ns in sys.modules:
            callbacks = sys.modules[ns].callbacks
            for name in CHECKPOINT_METHODS:
                recorder.patch(callbacks.ModelCheckpoint, name, checkpoint_tap(recorder, name))
