"""Rank side of all-rank-save: its sharded checks in the traced fit (imported only inside ranks).

Collective-bearing calls and saves are recorded by the generic recorder (``trace.py``); this
probe adds:

- Every ``LightningModule.load_from_checkpoint`` call is recorded with the layout of the path it
  was given (a file, an FSDP sharded directory, a DeepSpeed directory), and, when it raises on a
  sharded directory, a ``raised`` event naming all-rank-save as the owner of that failure.
- Library calls that make collectives for user code (TorchMetrics syncs, a DDP forward that
  broadcasts buffers, ModelCheckpoint called by user code) are traced at the user's call site
  (``taps.py``).
- Under the CPU sharded tier, after fit: every rank saves a sharded checkpoint directory, then a
  fresh module and Trainer with the matching strategy resume a short fit from it
  (``ckpt_path=dir``); the restored step and each rank's parameter-shard checksum are compared
  with the saved ones.
- After fit, on every strategy: which classes in the module's (and datamodule's) hyperparameters
  torch's ``weights_only`` loading refuses, per hparams key (a checkpoint of this module then
  cannot be resumed on one device either).
"""

from __future__ import annotations

import math
import os
import re
import sys

from ... import releases, sharded
from ...events import RAISED, Recorded, declare
from ...harness import build_trainer_kwargs
from ...runs import Probe
from ...sites import user_site
from ...target import loading as target_loading
from . import taps


class LoadEvent(Recorded):
    """A checkpoint loaded (``label``: ``Model.load_from_checkpoint`` or ``torch.load``): its ``path``,
    ``layout`` (what is at the path: a file, a sharded folder of FSDP or DeepSpeed), ``files``,
    ``site``, ``user``, ``hook`` and, for load_from_checkpoint, the run's ``strategy``."""

    label: str
    path: str
    layout: str
    files: list
    site: dict | None
    user: bool
    hook: str | None


LOAD = declare("load", LoadEvent)

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_REFUSED = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")
WEIGHTS_ONLY = "Weights only load failed"


def exc_text(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` without ANSI escape codes, on one line, cut at a sentence end when longer
    than ``limit`` characters; a weights_only refusal is shortened to the class it refused. A
    distributed checkpoint's ``CheckpointException`` (every failing rank's traceback in its text)
    names its ranks and the first rank's own exception instead."""
    failures = getattr(exc, "failures", None)
    inner = [pair[0] for pair in failures.values() if isinstance(pair, tuple) and pair
             and isinstance(pair[0], BaseException)] if isinstance(failures, dict) else []
    if inner:
        return f"{type(exc).__name__} on rank(s) {', '.join(map(str, sorted(failures)))}: {exc_text(inner[0], limit)}"
    text = " ".join(_ANSI.sub("", str(exc)).split())
    refused = _REFUSED.search(text)
    if WEIGHTS_ONLY in text and refused:
        text = f"{WEIGHTS_ONLY}: torch.load(weights_only=True) refused {refused.group(1)}."
    elif len(text) > limit:
        cut = text.rfind(". ", 0, limit)
        text = text[:cut + 1] if cut > 0 else text[:limit].rsplit(" ", 1)[0] + " (...)"
    return f"{type(exc).__name__}: {text}"


def checkpoint_layout(path) -> tuple[str | None, list[str]]:
    """('file' | 'fsdp' | 'deepspeed' | 'directory' | None, a few file names) for ``path``."""
    if not isinstance(path, (str, os.PathLike)):
        return None, []
    path = os.fspath(path)
    if os.path.isfile(path):
        return "file", []
    if not os.path.isdir(path):
        return None, []
    names = sorted(os.listdir(path))
    shown = names[:6] + ([f"... ({len(names)} entries)"] if len(names) > 6 else [])
    if ".metadata" in names or any(n.endswith(".distcp") for n in names):
        return "fsdp", shown
    if "latest" in names or any("zero_pp_rank" in n or "mp_rank" in n for n in names) or \
            any(os.path.isdir(os.path.join(path, n)) and any("zero_pp_rank" in m or "mp_rank" in m
                                                          for m in os.listdir(os.path.join(path, n)))
                for n in names):
        return "deepspeed", shown
    return "directory", shown


class _LoadTap:
    """Stands in for ``LightningModule.load_from_checkpoint`` (a class-only method descriptor):
    records the call, then defers to Lightning's own descriptor, which keeps its checks."""

    def __init__(self, original, recorder, strategy_text: str | None, saves: dict):
        self.original = original
        self.recorder = recorder
        self.strategy_text = strategy_text
        self.saves = saves

    def __get__(self, instance, owner=None):
        bound = self.original.__get__(instance, owner)
        recorder = self.recorder
        strategy_text, saves = self.strategy_text, self.saves
        cls_name = (owner or type(instance)).__name__

        def load_from_checkpoint(checkpoint_path, *args, **kwargs):
            site, direct = user_site()
            layout, files = checkpoint_layout(checkpoint_path)
            path = os.fspath(checkpoint_path) if isinstance(checkpoint_path, (str, os.PathLike)) else None
            recorder.emit({"ev": LOAD, "label": f"{cls_name}.load_from_checkpoint", "path": path,
                           "layout": layout, "files": files, "site": site, "user": direct,
                           "hook": recorder.current_hook(), "strategy": strategy_text,
                           "user_saves": saves.get("layout")})
            try:
                return bound(checkpoint_path, *args, **kwargs)
            except Exception as exc:
                if layout not in (None, "file"):
                    recorder.emit({"ev": RAISED, "in": "load_from_checkpoint", "owner": "all-rank-save",
                                   "exc": exc_text(exc, 200)})
                raise

        return load_from_checkpoint


def torch_load_tap(recorder, saves: dict):
    """Wrapper factory for ``torch.load``: a call from user code on a checkpoint directory (a
    sharded save under FSDP or DeepSpeed writes one) is recorded like a load_from_checkpoint, and
    its failure is named as this contract's. Files and library calls pass through untouched.
    ``saves["layout"]``: what the user's own strategy saves (:func:`sharded.saved_layout`)."""

    def factory(original):
        def load(f, *args, **kwargs):
            layout, files = checkpoint_layout(f)
            if layout in (None, "file"):
                return original(f, *args, **kwargs)
            site, direct = user_site()
            if not direct:
                return original(f, *args, **kwargs)
            recorder.emit({"ev": LOAD, "label": "torch.load", "path": os.fspath(f), "layout": layout,
                           "files": files, "site": site, "user": True, "hook": recorder.current_hook(),
                           "user_saves": saves.get("layout")})
            try:
                return original(f, *args, **kwargs)
            except Exception as exc:
                recorder.emit({"ev": RAISED, "in": "torch.load", "owner": "all-rank-save",
                               "exc": exc_text(exc, 200)})
                raise

        return load

    return factory


def refused_globals(obj, rounds: int = 6) -> list[str] | None:
    """The classes and functions in ``obj`` that ``torch.load(weights_only=True)`` refuses, found by
    allowlisting each refused one (``torch.serialization.safe_globals``) and loading again, at most
    ``rounds`` times; None when ``obj`` cannot be saved at all."""
    import io
    import pickle

    import torch

    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
    except Exception:
        return None
    refused: list[str] = []
    allowed: list = []
    for _ in range(rounds):
        buf.seek(0)
        try:
            with torch.serialization.safe_globals(allowed):
                torch.load(buf, weights_only=True)
            break
        except pickle.UnpicklingError as exc:
            found = _REFUSED.search(str(exc))
            target = _resolve(found.group(1)) if found else None
            if found is None or found.group(1) in refused:
                break
            refused.append(found.group(1))
            if target is None:
                break
            allowed.append(target)
        except Exception:
            break
    return refused


def _resolve(dotted: str):
    """The object a dotted ``module.attr`` path names, or None."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            return obj
        except AttributeError:
            return None
    return None


def hparams_refusals(model, datamodule) -> list[dict]:
    """``[{"owner": "model" | "datamodule", "key", "refused": [dotted names]}]``: the hparams
    entries a checkpoint stores that a weights_only load refuses (Lightning's default on resume)."""
    found = []
    for owner, obj in (("model", model), ("datamodule", datamodule)):
        hparams = getattr(obj, "hparams", None) if obj is not None else None
        if not hparams:
            continue
        for key, value in list(dict(hparams).items())[:50]:
            refused = refused_globals(value)
            if refused:
                found.append({"owner": owner, "key": str(key), "refused": refused})
    return found


def own_loader(cls: type) -> str | None:
    """The name of the class in ``cls``'s MRO that defines ``load_from_checkpoint`` when that is
    not Lightning's (a package's own loader, such as chemprop's); None when it is Lightning's."""
    for klass in cls.__mro__:
        if "load_from_checkpoint" in vars(klass):
            return None if klass.__module__.startswith(("lightning.", "pytorch_lightning.")) else klass.__name__
    return None


def _dcp_exception() -> type:
    """torch.distributed.checkpoint's CheckpointException derives from BaseException."""
    try:
        from torch.distributed.checkpoint.api import CheckpointException

        return CheckpointException
    except ImportError:
        return Exception


def _shard_checksum(module) -> float:
    import torch

    with torch.no_grad():
        return round(sum(float(p.detach().double().sum()) for p in module.parameters() if p.numel()), 6)


class ShardedSaveProbe(Probe):
    def __init__(self):
        self.data: dict = {"sharded": None}
        self.sharded_run = False
        self.saves: dict = {}  # "layout": what the user's own strategy saves (filled before the Trainer)

    def install(self, recorder):
        import torch

        taps.install(recorder)
        recorder.patch(torch, "load", torch_load_tap(recorder, self.saves))

    def before_trainer(self, objects, trainer_kwargs, recorder):
        # What wrote the checkpoints of this run: the user's strategy when the item runs it (the
        # same sharded kind), else the item's own (the deepspeed item of an FSDP config).
        user_strategy, run_strategy = objects.user_kwargs.get("strategy"), trainer_kwargs.get("strategy")
        kind = sharded.sharded_kind(run_strategy)
        source = user_strategy if kind and sharded.sharded_kind(user_strategy) == kind else run_strategy
        text = sharded.describe(source) if kind else None
        self.saves["layout"] = self.data["user_saves"] = sharded.saved_layout(user_strategy)
        for ns in ("lightning.pytorch", "pytorch_lightning"):
            if ns in sys.modules:
                module_cls = sys.modules[ns].LightningModule
                recorder.patch(module_cls, "load_from_checkpoint",
                                lambda original, t=text: _LoadTap(original, recorder, t, self.saves))
        # The round trip builds its own CPU FSDP Trainers: only on the CPU sharded tier.
        self.sharded_run = bool(getattr(trainer_kwargs.get("strategy"), "ltconform_cpu_tier", False))

    def after_fit(self, objects, trainer, recorder):
        with recorder.paused():
            try:
                self.data["weights_only"] = hparams_refusals(objects.model, objects.datamodule)
                self.data["own_loader"] = own_loader(type(objects.model))
                # What Lightning's loaders pass to torch.load depends on its release (releases.py).
                self.data["lightning"] = releases.of_object(trainer)
            except Exception:  # an observation, never a reason for the run to fail
                self.data["weights_only"] = []
            if self.sharded_run:
                self.data["sharded"] = _round_trip(objects, trainer)

    def collect(self, objects, trainer, recorder):
        return self.data


def _round_trip(objects, trainer) -> dict:
    """Save a sharded checkpoint on every rank, resume a short fit from it with the matching
    strategy, and compare the restored step and parameter shard with the saved ones."""
    out: dict = {"phase": "save", "error": None}
    path = os.path.join(trainer.default_root_dir, "ltconform-sharded.ckpt")
    try:
        _save_sharded(trainer, path)
        layout, files = checkpoint_layout(path)
        out.update(layout=layout, files=files, saved_step=int(trainer.global_step),
                   saved_epoch=int(trainer.current_epoch), saved_checksum=_shard_checksum(objects.model))
        out["phase"] = "resume"
        seen = _Resume(objects, trainer, path).restore(out)
        if seen is None:
            return out
        out.update(restored_step=seen.get("step"), restored_checksum=seen.get("checksum"))
        saved = out["saved_checksum"]
        if not math.isfinite(saved):
            out["nonfinite"] = True  # nan never equals nan: nothing to compare the restored weights with
            return out
        out["restored_ok"] = (seen.get("step") == out["saved_step"] and seen.get("checksum") is not None
                              and abs(seen["checksum"] - saved) <= 1e-5 * max(1.0, abs(saved)))
    except (Exception, _dcp_exception()) as exc:  # reported as the round trip's failure, not a broken run
        out["error"] = exc_text(exc)
        out["weights_only"] = WEIGHTS_ONLY in str(exc)
        out["frame"] = _raising_frame(exc)
    return out


def _raising_frame(exc: BaseException) -> dict | None:
    """``{"file", "line", "func"}`` of the frame that raised ``exc`` (the innermost of its traceback)."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return {"file": frames[-1].filename, "line": frames[-1].lineno, "func": frames[-1].name} if frames else None


def _save_sharded(trainer, path: str) -> None:
    strategy = trainer.strategy
    previous = strategy._state_dict_type
    try:
        strategy._state_dict_type = "sharded"
        trainer.save_checkpoint(path)
    finally:
        strategy._state_dict_type = previous


_VALIDATION_CODE = ("validation_step", "on_validation_start", "on_validation_epoch_start", "on_validation_batch_start",
                    "on_validation_batch_end", "on_validation_epoch_end", "on_validation_end")


def _no_op(*args, **kwargs) -> None:
    return None


def _fresh_user_kwargs(objects) -> dict:
    """The user's Trainer kwargs with callbacks of their own that no Trainer has used yet: a
    factory's, built again, or a dict's, copied; without a copy, no callbacks of theirs."""
    import copy

    user = target_loading.user_trainer_kwargs(objects.target)
    if objects.target.trainer_dict is not None and user.get("callbacks") is not None:
        try:
            user["callbacks"] = copy.deepcopy(user["callbacks"])
        except Exception:  # a callback that cannot be copied is not shared with the fit's Trainer
            user.pop("callbacks")
    return user


class _Resume:
    """A fresh module, datamodule and Trainer with the matching strategy, restored from ``path``."""

    def __init__(self, objects, trainer, path: str):
        self.objects = objects
        self.trainer = trainer
        self.path = path
        self.seen: dict = {}
        timeout = getattr(trainer.strategy, "_timeout", None)
        self.timeout_s = timeout.total_seconds() if timeout else None

    def strategy(self):  # a Trainer binds its strategy: each Trainer gets a new one
        made = sharded.cpu_fsdp_strategy(self.objects.ns, self.objects.user_kwargs.get("strategy"), self.timeout_s)
        made._state_dict_type = "sharded"
        return made

    def callback(self):
        seen = self.seen

        class RestoreCheck(self.objects.ns.Callback):
            def on_load_checkpoint(self, trainer, pl_module, checkpoint):
                # The weights are loaded by now: what fails after this is not the checkpoint's doing.
                seen.update(restored=True, step=int(checkpoint.get("global_step", -1)),
                            checksum=_shard_checksum(pl_module))

            def on_train_start(self, trainer, pl_module):
                seen.update(step=int(trainer.global_step), checksum=_shard_checksum(pl_module))

            def on_validation_start(self, trainer, pl_module):
                seen.setdefault("checksum", _shard_checksum(pl_module))

        return RestoreCheck()

    def kwargs(self) -> dict:
        """The user's own Trainer config, bounded as every run, for one more epoch of one batch:
        validation, its sanity check and the user's callbacks (fresh ones) stay as configured, so a
        scheduler or callback that monitors a validation metric finds it, as on the user's resume."""
        trainer = self.trainer
        user = {k: v for k, v in _fresh_user_kwargs(self.objects).items()
                if k not in ("strategy", "max_steps", "profiler", "plugins")}
        user["limit_train_batches"] = 1  # given here, so a validation interval is bounded by it too
        kwargs = build_trainer_kwargs(user, self.strategy(), trainer.world_size,
                                      os.path.join(trainer.default_root_dir, "ltconform-resume"))
        kwargs.update(max_epochs=int(trainer.current_epoch) + 1, max_steps=-1,
                      callbacks=list(kwargs.get("callbacks") or []) + [self.callback()])
        return kwargs

    def restore(self, out: dict) -> dict | None:
        """What the resumed run saw (step, checksum); None when the weights could not be checked."""
        objects = self.objects
        # A module and datamodule as the user's code builds them, never trained.
        model, datamodule = objects.new_model(), objects.new_datamodule()
        kwargs = self.kwargs()
        stateless = all(not getattr(opt, "state", None) for opt in self.trainer.optimizers)
        try:
            objects.ns.Trainer(**kwargs).fit(model, datamodule=datamodule, ckpt_path=self.path)
            return self.seen
        except (Exception, _dcp_exception()) as exc:
            if self.seen.get("restored"):
                # The checkpoint loaded; the rest of the resumed epoch is the user's run, judged by the fit.
                out["after_restore"] = exc_text(exc, 200)
                return self.seen
            # An optimizer without state (plain SGD) saves an empty "state" that the sharded format
            # drops, and Lightning 2.6.6 then refuses the optimizer on resume. Check the weights
            # through validate(ckpt_path=dir), which loads no optimizer, and report the limitation.
            if not (isinstance(exc, ValueError) and stateless and "optim_state_dict" in str(exc)):
                raise
            out["limitation"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        return self._validate(kwargs, out)

    def _validate(self, kwargs: dict, out: dict) -> dict | None:
        objects = self.objects
        model, datamodule = objects.new_model(), objects.new_datamodule()  # the failed fit left the first one wrapped
        if not target_loading.defines(model, "validation_step", objects.target.namespace):
            # Nothing to evaluate the restored weights with: the save itself is what was checked.
            out["unchecked"] = "the module defines no validation_step to load the weights through"
            return None
        kwargs.update(limit_val_batches=1, strategy=self.strategy(), callbacks=[self.callback()])
        # The batch only carries the restore; the user's validation code (its logs and collectives)
        # is judged by the fit, not by this check of the weights.
        for name in _VALIDATION_CODE:
            setattr(model, name, _no_op)
        self.seen.clear()
        objects.ns.Trainer(**kwargs).validate(model, datamodule=datamodule, ckpt_path=self.path, verbose=False)
        self.seen["step"] = out["saved_step"]  # validate restores no loop state
        return self.seen
