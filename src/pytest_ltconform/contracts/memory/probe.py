"""Rank side of the memory contract, in the traced fit every fit-based contract shares.

During the first :data:`WATCHED` training batches each rank counts what it holds
(:func:`.held.held`) before and after the optimizer step, and the bytes autograd saves for
backward during the step's forward (the activations; a storage counted once, parameters and
their views not counted). Rank 0 then predicts the production step (:mod:`.predict`) in a child
process forked for that alone (:mod:`.apart`), so a trace that breaks torch's state breaks nothing
the rank runs later. Nothing here may break the user's run: a failure becomes a reason in the
observations.
"""

from __future__ import annotations

from ...runs import Probe
from .held import CATEGORIES, Activations, held

WATCHED = 3  # training batches measured: the optimizer state exists from the second one on


class MemoryProbe(Probe):
    def __init__(self):
        self.peak = dict.fromkeys(CATEGORIES, 0)
        self.storages = dict.fromkeys(CATEGORIES, 0)
        self.activations = 0
        self.batches = 0
        self.errors: list[str] = []
        self.setting: dict = {}

    def _measure(self, trainer) -> None:
        try:
            now = held(trainer)
        except Exception as exc:  # reading must never break the user's run
            self.errors.append(f"{type(exc).__name__}: {exc}")
            return
        for cat in CATEGORIES:
            if now["bytes"][cat] > self.peak[cat]:
                self.peak[cat], self.storages[cat] = now["bytes"][cat], now["storages"][cat]

    def before_trainer(self, objects, trainer_kwargs, recorder) -> None:
        probe = self

        class MemoryWatch(objects.ns.Callback):
            def on_before_optimizer_step(self, trainer, pl_module, optimizer):
                if probe.batches < WATCHED:
                    probe._measure(trainer)

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if probe.batches < WATCHED:
                    probe._measure(trainer)
                probe.batches += 1

        trainer_kwargs["callbacks"] = list(trainer_kwargs.get("callbacks") or []) + [MemoryWatch()]

    def before_fit(self, objects, trainer, recorder) -> None:
        strategy = trainer.strategy
        training_step = strategy.training_step
        probe = self

        def measured_step(*args, **kwargs):
            if probe.batches >= WATCHED:
                return training_step(*args, **kwargs)
            import torch

            saved = Activations()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                out = training_step(*args, **kwargs)
            probe.activations = max(probe.activations, saved.bytes)
            return out

        object.__setattr__(strategy, "training_step", measured_step)
        self.setting = _setting(trainer, objects.user_kwargs.get("strategy"))

    def collect(self, objects, trainer, recorder):
        out = {"bytes": dict(self.peak, activations=self.activations), "storages": dict(self.storages),
               "batches": min(self.batches, WATCHED), "errors": self.errors[:3], **self.setting,
               **_cuda_figures(trainer)}
        if trainer is not None and trainer.global_rank == 0:
            out["prediction"] = _predicted(objects, recorder, trainer.world_size, _kill_after_s(trainer))
        return out


def _setting(trainer, user_strategy) -> dict:
    """What this run measured under (its strategy, ranks, precision, device), and the strategy the
    user's Trainer config names (its label, and what it offloads)."""
    from .predict import configured, offloads, strategy_label

    strategy = trainer.strategy
    precision = getattr(trainer.precision_plugin, "precision", None) or "32-true"
    return {"strategy": strategy_label(strategy), "world_size": int(trainer.world_size),
            "precision": str(precision), "device": str(getattr(strategy, "root_device", "cpu")),
            "configured": configured(user_strategy), "offload": offloads(user_strategy)}


def _cuda_figures(trainer) -> dict:
    """On a CUDA rank: the device's capacity and the allocator's peak for this run (bytes)."""
    try:
        import torch

        device = trainer.strategy.root_device
        if device.type != "cuda":
            return {}
        return {"device_total": int(torch.cuda.get_device_properties(device).total_memory),
                "cuda_peak": int(torch.cuda.max_memory_allocated(device))}
    except Exception:
        return {}


def _predicted(objects, recorder, world_size: int, kill_after_s: float = 60.0) -> dict:
    """The production step's figures, traced in a child forked for it alone (``apart.py``), or
    ``{"error": why}``."""
    import os
    import tempfile

    import torch

    from ...world.rank import current_context
    from .apart import traced_apart
    from .predict import CannotTrace, first_batch, predict, stopped

    try:  # here, where the loader sees the rank's process group; the random state kept
        with recorder.paused() if recorder is not None else _nothing(), torch.random.fork_rng(devices=[]):
            first = first_batch(objects)
    except CannotTrace as exc:
        return {"error": str(exc)}

    def trace() -> dict:
        try:
            with recorder.paused() if recorder is not None else _nothing():
                return predict(objects, world_size, first=first)
        except CannotTrace as exc:
            return {"error": str(exc)}
        except Exception as exc:  # the user's module may refuse fake tensors in many ways
            return {"error": stopped("tracing the production step", exc)}

    ctx = current_context()
    folder = ctx.job_dir if ctx is not None else tempfile.gettempdir()
    return traced_apart(trace, os.path.join(folder, "memory-trace.log"), kill_after_s)


def _kill_after_s(trainer) -> float:
    """The process group's timeout plus 2 s: rank 0 waits for the trace after its peers finished,
    and the supervisor takes a rank still running 10 s past that timeout for hung."""
    timeout = getattr(getattr(trainer, "strategy", None), "_timeout", None)
    seconds = getattr(timeout, "total_seconds", lambda: 30.0)()
    return seconds + 2.0


def _nothing():
    import contextlib

    return contextlib.nullcontext()
