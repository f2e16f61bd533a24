"""data-sharding: every rank trains on its own share of the data, in a fresh order each epoch,
with the same number of batches per epoch.

Seed section "Sampling, metrics and writes": Lightning swaps ordinary map-style samplers for a
DistributedSampler, but an IterableDataset is not sharded for you, a sampler you own
(``use_distributed_sampler=False``) must shard by rank and worker and be reseeded every epoch,
and Lightning must be able to re-create your DataLoader to inject its sampler.

Checked from the traced fit: every train and validation batch is fingerprinted per rank and
epoch (a hash per sample row and per batch, recorded into the trace so that a hung world keeps
them). It fails when ranks draw identical batches, when one rank sees the same samples several
times in an epoch (DataLoader workers replaying a stream), when a user-owned shuffling sampler
gives the same order every epoch, when ranks' DataLoaders differ in length (the next collective
pairs the wrong steps or hangs; a rank that stopped early or hangs is not the data's fault), when
random inputs drawn in training_step are the same on every rank, and when Lightning could not
re-create the DataLoader with its DistributedSampler (the cause and the DataLoader's file:line, not
a raw traceback). Samplers that draw with replacement may repeat samples.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

from ..harness import batch_leaves, batch_size
from ..sites import first_sentence, fmt_site
from . import fetches, loader_sites
from .base import Blame, Contract, Evidence, Probe, Run, Verdict, class_site, merged, user_class
from .rank_reads import describe, gating_reads, selecting_reads

ROWS_PER_BATCH = 64        # sample rows hashed per batch
BATCHES_PER_EPOCH = 8      # batches fingerprinted per epoch and stage (all are counted)
STREAM_COUNT_LIMIT = 100_000
DRAW_STEPS = 8             # training steps whose random draws are fingerprinted
DRAWS_PER_STEP = 8


# -- rank side: fingerprints -------------------------------------------------------------------

def _row_bytes(t) -> bytes:
    import torch

    t = t.detach().cpu().contiguous().reshape(-1)
    if t.dtype in (torch.bfloat16,) or t.is_complex():
        t = torch.view_as_real(t) if t.is_complex() else t.float()
    return t.numpy().tobytes()


def fingerprint(batch, rows: int = ROWS_PER_BATCH) -> dict:
    """``{"n": batch size, "fp": batch hash, "rows": [per-sample hashes]}`` of one batch;
    ``{"n": None}`` for a batch without tensor leaves (not fingerprinted)."""
    import hashlib

    import torch

    leaves: list = []
    batch_leaves(batch, leaves)
    if not any(isinstance(t, torch.Tensor) for t in leaves):
        return {"n": None}
    n = batch_size(batch)
    whole = hashlib.blake2b(digest_size=8)
    row_hashes = []
    if n:
        per_row = [hashlib.blake2b(digest_size=8) for _ in range(min(n, rows))]
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == n:
                for i, h in enumerate(per_row):
                    h.update(_row_bytes(t[i]))
        row_hashes = [h.hexdigest() for h in per_row]
    ids = None
    if n:
        for t in leaves:  # an integer vector per sample reads as sample ids in the evidence
            if isinstance(t, torch.Tensor) and t.dim() == 1 and t.shape[0] == n and not t.is_floating_point() \
                    and t.dtype != torch.bool:
                ids = [int(v) for v in t[:rows]]
    for t in leaves:
        if isinstance(t, torch.Tensor):
            whole.update(_row_bytes(t) if t.numel() <= 1_000_000 else repr(t.shape).encode())
        else:
            whole.update(repr(t).encode()[:1000])
    out = {"n": n, "fp": whole.hexdigest(), "rows": row_hashes}
    if ids is not None:
        out["ids"] = ids
    return out


def _class_site(cls) -> dict | None:
    import inspect

    try:
        lines, line = inspect.getsourcelines(cls)
        return {"file": inspect.getsourcefile(cls), "line": line, "func": cls.__qualname__}
    except (TypeError, OSError):
        return None


def _loader_info(trainer, stage: str, loader) -> dict:
    from torch.utils.data import DataLoader, IterableDataset

    info = {"ev": "ds_loader", "stage": stage, "type": type(loader).__name__}
    if isinstance(loader, DataLoader):
        ds = loader.dataset
        bs = loader.batch_sampler
        sampler = loader.sampler
        inner = getattr(bs, "sampler", None)
        info.update(
            dataset=type(ds).__qualname__, dataset_site=_class_site(type(ds)),
            iterable=isinstance(ds, IterableDataset), num_workers=int(loader.num_workers),
            batch_size=loader.batch_size, sampler=type(sampler).__name__ if sampler is not None else None,
            batch_sampler=type(bs).__name__ if bs is not None else None,
            inner_sampler=type(inner).__name__ if inner is not None else None,
            shuffle=bool(getattr(inner if inner is not None else sampler, "shuffle", False)),
            created_at=getattr(loader, "_ltconform_site", None),
        )
        try:
            info["length"] = len(loader)
        except TypeError:
            info["length"] = None
        info.update(_order_info(loader))
    info["use_distributed_sampler"] = bool(getattr(trainer._accelerator_connector, "use_distributed_sampler", True))
    return info


def _samplers(loader) -> list:
    """The loader's sampler, batch sampler, the batch sampler's sampler and the sampler that
    Lightning's DistributedSamplerWrapper wraps (whichever exist)."""
    bs = getattr(loader, "batch_sampler", None)
    chain = [s for s in (getattr(loader, "sampler", None), bs, getattr(bs, "sampler", None)) if s is not None]
    for s in list(chain):
        wrapped = getattr(getattr(s, "dataset", None), "_sampler", None)  # DistributedSamplerWrapper
        if wrapped is not None:
            chain.append(wrapped)
    return chain


def _shuffles_in_iter(cls) -> bool:
    """Whether a user IterableDataset's __iter__ (or what it calls on the class) shuffles."""
    import inspect

    from ..sites import is_user_file

    try:
        path = inspect.getsourcefile(cls)
        source = inspect.getsource(cls)
    except (TypeError, OSError):
        return False
    return bool(path and is_user_file(path) and re.search(r"shuffle|randperm|permutation", source))


def _order_info(loader) -> dict:
    """What decides the sample order of a DataLoader: replacement sampling, a custom batch
    sampler, a dataset that shuffles itself."""
    from torch.utils.data import BatchSampler, IterableDataset

    bs = loader.batch_sampler
    return {
        "replacement": any(getattr(s, "replacement", False) is True for s in _samplers(loader)),
        "samplers": [type(s).__name__ for s in _samplers(loader)],
        "custom_batch_sampler": type(bs).__name__ if bs is not None and type(bs) is not BatchSampler else None,
        "batch_sampler_shuffles": bool(getattr(bs, "shuffle", False)) or _shuffles_in_iter(type(bs)),
        "drop_last": bool(getattr(bs, "drop_last", False) or loader.drop_last),
        "dataset_shuffles": isinstance(loader.dataset, IterableDataset) and _shuffles_in_iter(type(loader.dataset)),
    }


def _first_loader(loaders):
    if isinstance(loaders, (list, tuple)):
        return loaders[0] if loaders else None
    if isinstance(loaders, dict):
        return next(iter(loaders.values()), None)
    return loaders


def count_stream(dataset, limit: int = STREAM_COUNT_LIMIT, seconds: float = 3.0) -> int | None:
    """How many items one fresh iterator of an IterableDataset yields (None past the bounds).
    Counted in a daemon thread, so a stream that blocks cannot hold up the rank."""
    import threading

    box: dict = {}

    def count() -> None:
        n = 0
        try:
            for _ in dataset:
                n += 1
                if n >= limit or box.get("stop"):
                    return
        except Exception:
            return
        box["n"] = n

    worker = threading.Thread(target=count, name="ltconform-stream-count", daemon=True)
    worker.start()
    worker.join(seconds)
    box["stop"] = True  # past the bound the thread stops at its next item
    return box.get("n")


def _creation_site() -> dict | None:
    """The user's frame that built a DataLoader: the first user frame that is not a DataLoader
    subclass's own __init__."""
    import sys

    from ..sites import is_user_file

    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if is_user_file(code.co_filename) and code.co_name != "__init__":
            func = getattr(code, "co_qualname", code.co_name)
            return {"file": code.co_filename, "line": frame.f_lineno, "func": func}
        frame = frame.f_back
    return None


# Random values a step feeds to the model (noise, latents). Index draws (randint, randperm,
# multinomial) are left out: identical on every rank they still pick different samples from each
# rank's own batch (seen in neuralforecast's window sampling), so they prove nothing.
RANDOM_FACTORIES = ("randn", "rand", "randn_like", "rand_like", "normal")
RANDOM_METHODS = ("normal_", "uniform_")


# Ops whose output carries a draw on without deciding its use: shape and dtype changes,
# concatenation (a conditional GAN's latent next to its labels is still the latent).
_CARRIES = frozenset({"cat", "concat", "concatenate", "stack", "hstack", "vstack", "float", "double", "half",
                      "to", "view", "reshape", "unsqueeze", "squeeze", "expand", "expand_as", "repeat",
                      "flatten", "transpose", "permute", "contiguous", "clone", "detach", "type_as", "__getitem__"})


def _tensors(obj, out: list, depth: int = 0) -> list:
    import torch

    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for item in obj:
            _tensors(item, out, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for item in obj.values():
            _tensors(item, out, depth + 1)
    return out


def _is_weight(t) -> bool:
    import torch

    return isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad)


def _uses_mode(draws):
    """A TorchFunctionMode that follows each recorded draw to the first op that decides its use
    (see :meth:`_Draws.follow`); built lazily (no torch import at module level)."""
    from torch.overrides import TorchFunctionMode

    class DrawUses(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if draws.tracked:
                try:
                    draws.follow(func, args, kwargs or {}, out)
                except Exception:
                    pass  # following a draw must never change the step
            return out

    return DrawUses()


class _Draws:
    """Fingerprints what torch's random factories return to user code inside training_step, for
    the first DRAW_STEPS steps: one ``ds_draw`` event (the user's file:line, a 64-bit hash of the
    first 64 values) per draw, at most DRAWS_PER_STEP per step. Each draw is followed to the first
    op that meets another tensor: only weights there means the draw is the model's input (a GAN's
    latent); a tensor of the rank's own data means noise combined with it (a VAE's
    reparameterisation, a dropout mask): one ``ds_draw_use`` event says which."""

    def __init__(self, recorder):
        self.recorder = recorder
        self.module = None
        self.key = None      # [epoch, batch_idx] while a recorded step runs
        self.steps = 0
        self.count = 0
        self.busy = False
        self.ids = 0
        self.tracked: dict = {}   # id(tensor) -> (weakref to it, draw id)
        self.mode = None

    def follow(self, func, args, kwargs, out) -> None:
        tensors = _tensors(kwargs, _tensors(args, []))
        hits, others = set(), []
        for t in tensors:
            draw = self.tracked.get(id(t))
            if draw is not None and draw[0]() is t:
                hits.add(draw[1])
            elif t.numel() > 1:
                others.append(t)
        if not hits:
            return
        name = getattr(func, "__name__", str(func))
        if name in _CARRIES or not others:
            for o in _tensors(out, []):
                self._track(o, min(hits))
            return
        use = "input" if all(_is_weight(t) for t in others) else "combined"
        for draw_id in hits:
            self.recorder.emit({"ev": "ds_draw_use", "id": draw_id, "use": use, "op": name})
        self.tracked = {k: v for k, v in self.tracked.items() if v[1] not in hits}

    def _track(self, tensor, draw_id: int) -> None:
        import weakref

        self.tracked[id(tensor)] = (weakref.ref(tensor), draw_id)

    def enter(self) -> None:
        if self.key is not None and self.mode is None:
            self.mode = _uses_mode(self)
            self.mode.__enter__()

    def leave(self) -> None:
        self.key = None
        self.tracked = {}
        if self.mode is not None:
            mode, self.mode = self.mode, None
            mode.__exit__(None, None, None)

    def install(self) -> None:
        import torch

        for name in RANDOM_FACTORIES:
            if hasattr(torch, name):
                self.recorder.patch(torch, name, lambda original, n=name: self._wrap(original, f"torch.{n}"))
        for name in RANDOM_METHODS:  # defined on torch._C.TensorBase: shadowed on torch.Tensor
            self.recorder.patch(torch.Tensor, name, lambda original, n=name: self._wrap(original, f"Tensor.{n}"),
                                inherited=True)

    def _wrap(self, original, label: str):
        draws = self

        def wrapper(*args, **kwargs):
            out = original(*args, **kwargs)
            if draws.key is not None and not draws.busy:
                draws.record(label, out)
            return out

        return wrapper

    def step(self, module, epoch: int, batch_idx: int) -> None:
        self.module, self.count = module, 0
        self.key = [epoch, batch_idx] if self.steps < DRAW_STEPS else None
        self.steps += 1

    def record(self, label: str, out) -> None:
        import hashlib

        import torch

        from ..sites import user_site

        if (not isinstance(out, torch.Tensor) or self.count >= DRAWS_PER_STEP
                or getattr(self.module, "_current_fx_name", None) != "training_step"):
            return
        self.busy = True
        try:
            site, _ = user_site(2)
            if site is not None:
                self.count += 1
                digest = hashlib.blake2b(_row_bytes(out.detach().reshape(-1)[:64]), digest_size=8).hexdigest()
                self.ids += 1
                self.recorder.emit({"ev": "ds_draw", "fn": label, "site": site, "key": self.key, "hash": digest,
                                    "shape": list(out.shape), "id": self.ids})
                self._track(out, self.ids)
        except Exception:
            pass  # a fingerprint that cannot be taken is not recorded
        finally:
            self.busy = False


INDEX_GROUPS = 64          # index groups (one per batch the loader fetches) recorded per stage and epoch
INDEX_KEYS = 256           # dataset keys recorded per group
_STAGE_NAMES = {"train": "train", "validate": "val", "test": "test", "predict": "predict"}


def _keys(index) -> list | None:
    """The dataset keys one fetch hands ``__getitem__``/``__getitems__``: one key, or the list a
    batch sampler yields; None for an iterable dataset's placeholder (no key)."""
    if index is None:
        return None
    items = index if isinstance(index, (list, tuple)) else [index]
    out = []
    for k in items[:INDEX_KEYS]:
        try:
            out.append(int(k))
        except (TypeError, ValueError):
            out.append(repr(k)[:60])  # a key that is not an integer (a string, a tuple) still names one sample
    return out


_STAGE_LOADERS = {"train": "train_dataloader", "val": "val_dataloaders", "test": "test_dataloaders",
                  "predict": "predict_dataloaders"}


def _stage_loaders(trainer, stage: str) -> list | None:
    """The DataLoaders Lightning iterates for ``stage``'s steps (``trainer.train_dataloader`` and
    its siblings, nested in lists or dicts); None when they cannot be read (then every fetch of the
    stage counts, as before)."""
    try:
        iterables = getattr(trainer, _STAGE_LOADERS[stage])
    except Exception:
        return None
    found: list = []
    todo = [iterables]
    while todo:
        obj = todo.pop()
        if isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif obj is not None and hasattr(obj, "dataset"):
            found.append(obj)
    return found or None


def _is_stage_stream(trainer, stage: str, index_sampler=None, dataset=None) -> bool:
    """Whether a fetch belongs to the loader(s) the stage's loop iterates, not to a DataLoader the
    user iterates inside a hook (a baseline rollout over a fixed set in on_train_epoch_end runs on
    every rank on purpose, rule 'Sampling, metrics and writes'). A map-style iterator is known by
    its loader's index sampler (unique to the loader), an iterable one by its dataset."""
    loaders = _stage_loaders(trainer, stage) or []
    # loaders that cannot be read or matched (a wrapper that is no torch DataLoader): every fetch counts
    if index_sampler is not None:
        known = [dl._index_sampler for dl in loaders if hasattr(dl, "_index_sampler")]
        return not known or any(s is index_sampler for s in known)
    return not loaders or any(getattr(dl, "dataset", None) is dataset for dl in loaders)


class _Indices:
    """Records, per stage and epoch, the keys every fetch of a map-style dataset receives: the
    source of its samples. Read in the main process where the DataLoader iterator draws them from
    its sampler, so DataLoader workers (num_workers>0), batch samplers yielding index lists and
    collated graphs are all read the same way; one ``ds_index`` event per fetch."""

    def __init__(self, recorder):
        self.recorder = recorder
        self.counts: dict = defaultdict(int)

    def install(self) -> None:
        fetches.tap(self.recorder, self.record)

    def record(self, it, index) -> None:
        trainer = self.recorder.trainer
        if trainer is None or trainer.sanity_checking or getattr(it, "_dataset_kind", 0) != 0:
            return  # 0: a map-style dataset (torch's _DatasetKind.Map)
        stage = _STAGE_NAMES.get(str(getattr(trainer.state.stage, "value", trainer.state.stage)))
        keys = _keys(index)
        if stage is None or keys is None or not _is_stage_stream(trainer, stage, index_sampler=it._index_sampler):
            return
        key = (stage, int(trainer.current_epoch))
        self.counts[key] += 1
        if self.counts[key] <= INDEX_GROUPS:
            self.recorder.emit({"ev": "ds_index", "stage": stage, "keys": keys, "ds": id(it._dataset),
                                "dataset": type(it._dataset).__qualname__})


ITEMS_PER_ITERATOR = 256   # items hashed per iterator of an IterableDataset (per worker, stage and epoch)


def _item_hash(item) -> str:
    """A 64-bit hash of one item an IterableDataset yields: its tensor and plain leaves."""
    import hashlib

    import torch

    leaves: list = []
    batch_leaves(item, leaves)
    h = hashlib.blake2b(digest_size=8)
    for leaf in leaves:
        h.update(_row_bytes(leaf) if isinstance(leaf, torch.Tensor) and leaf.numel() <= 1_000_000
                 else repr(leaf).encode()[:1000])
    return h.hexdigest()


class _Items:
    """Records what an IterableDataset's iterator yields, item by item, per stage, epoch and
    DataLoader worker: the source of its samples (``ds_item`` events). A worker process writes
    its line straight to the rank's trace file (one append each), not through the recorder, whose
    lock may have been held by another thread when the worker was forked."""

    def __init__(self, recorder):
        import os

        self.recorder = recorder
        self.pid = os.getpid()

    def install(self) -> None:
        from torch.utils.data._utils import fetch

        self.recorder.patch(fetch._IterableDatasetFetcher, "__init__", self._wrap)

    def _wrap(self, original):
        items = self

        def __init__(fetcher, *args, **kwargs):
            original(fetcher, *args, **kwargs)
            try:
                where = items.where()
                if where is not None and _is_stage_stream(items.recorder.trainer, where["stage"],
                                                          dataset=fetcher.dataset):
                    fetcher.dataset_iter = items.tap(fetcher.dataset_iter, where)
            except Exception:
                pass  # an iterator that cannot be followed is fingerprinted by its batches instead

        return __init__

    def where(self) -> dict | None:
        from torch.utils.data import get_worker_info

        trainer = self.recorder.trainer
        if trainer is None or trainer.sanity_checking:
            return None
        stage = _STAGE_NAMES.get(str(getattr(trainer.state.stage, "value", trainer.state.stage)))
        if stage is None:
            return None
        info = get_worker_info()
        return {"ev": "ds_item", "stage": stage, "epoch": int(trainer.current_epoch),
                "w": info.id if info is not None else 0, "nw": info.num_workers if info is not None else 1}

    def tap(self, iterator, where: dict):
        for n, item in enumerate(iterator):
            if n < ITEMS_PER_ITERATOR:
                try:
                    self.emit({**where, "h": _item_hash(item)})
                except Exception:
                    pass  # an item that cannot be hashed is not recorded; the user's stream goes on
            yield item

    def emit(self, event: dict) -> None:
        import json
        import os

        if os.getpid() == self.pid:
            self.recorder.emit(event)
        else:
            os.write(self.recorder._fh.fileno(), (json.dumps(event) + "\n").encode())


class DataShardingProbe(Probe):
    """Records one ``batch`` event per batch, one ``ds_loader`` event per stage and epoch, the
    item count of a train IterableDataset (``ds_stream``), random draws in training_step and the
    rank reads of user code inside step hooks (``rank_read``, see :mod:`.rank_reads`)."""

    def __init__(self):
        self._loaders: dict[str, object] = {}
        self._recorder = None
        self._draws = None
        self._streams: set = set()

    def install(self, recorder) -> None:
        loader_sites.install(recorder)

    def before_trainer(self, loaded, trainer_kwargs, recorder) -> None:
        import torch.utils.data as tud

        from .rank_reads import RankReads, step_hook

        self._draws = _Draws(recorder)
        self._draws.install()
        _Indices(recorder).install()
        _Items(recorder).install()
        RankReads(recorder.emit, lambda: step_hook(recorder.trainer)).install(loaded.ns, recorder)

        def factory(original):
            def __init__(loader, *args, **kwargs):
                original(loader, *args, **kwargs)
                if getattr(loader, "_ltconform_site", None) is not None:
                    return  # a subclass's __init__ already recorded the outer call
                site = _creation_site()
                if site is None:
                    return  # built by Lightning (sampler injection) or a library, not by the user
                try:
                    object.__setattr__(loader, "_ltconform_site", site)
                    recorder.emit({"ev": "ds_created", "site": site, "positional": len(args) + 1,
                                   "cls": type(loader).__name__, "hook": recorder.current_hook()})
                except Exception:
                    pass

            return __init__

        recorder.patch(tud.DataLoader, "__init__", factory)
        self._recorder = recorder
        trainer_kwargs["callbacks"] = list(trainer_kwargs.get("callbacks") or []) + \
            [self._callback(loaded.ns, recorder)]

    def watch_sampler(self, sampler) -> None:
        """Record the first indices each iteration of a user-defined sampler yields."""
        import inspect

        from ..sites import is_user_file

        cls = type(sampler)
        try:
            path = inspect.getsourcefile(cls)
        except TypeError:
            return
        if not path or not is_user_file(path) or "__iter__" not in cls.__dict__:
            return
        recorder = self._recorder

        def factory(original):
            def __iter__(obj):
                got, done = [], False
                try:
                    limit = max(1, min(ROWS_PER_BATCH, len(obj)))
                except Exception:
                    limit = ROWS_PER_BATCH
                for item in original(obj):
                    if not done:
                        try:
                            got.append([int(i) for i in item] if isinstance(item, (list, tuple)) else int(item))
                        except Exception:
                            got.append(repr(item)[:40])
                        if len(got) >= limit:
                            recorder.emit({"ev": "ds_sampler", "cls": cls.__name__, "indices": got})
                            done = True
                    yield item
                if not done:
                    recorder.emit({"ev": "ds_sampler", "cls": cls.__name__, "indices": got})

            return __iter__

        recorder.patch(cls, "__iter__", factory)

    def _callback(self, ns, recorder):
        probe = self

        class Fingerprints(ns.Callback):
            def __init__(self):
                self.seen: dict[tuple, int] = defaultdict(int)

            def _loader(self, trainer, stage, loaders):
                loader = _first_loader(loaders)
                probe._loaders[stage] = loader
                for sampler in (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
                                getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
                    if sampler is not None:
                        probe.watch_sampler(sampler)
                try:
                    recorder.emit({**_loader_info(trainer, stage, loader),
                                   "built": loader_sites.loader_of(f"{stage}_dataloader")})
                except Exception as exc:
                    recorder.emit({"ev": "trace_error", "where": "data-sharding loader", "error": repr(exc)})

            def _batch(self, trainer, stage, batch, batch_idx, dataloader_idx=0):
                key = (stage, int(trainer.current_epoch), dataloader_idx)
                self.seen[key] += 1
                event = {"ev": "batch", "stage": stage, "idx": int(batch_idx), "dl": dataloader_idx}
                try:
                    if self.seen[key] <= BATCHES_PER_EPOCH:
                        event.update(fingerprint(batch))
                    else:
                        event["n"] = batch_size(batch)
                except Exception as exc:
                    event["error"] = repr(exc)
                recorder.emit(event)

            def on_train_epoch_start(self, trainer, pl_module):
                self._loader(trainer, "train", trainer.train_dataloader)
                probe.count_train_stream(recorder)

            def on_validation_epoch_start(self, trainer, pl_module):
                if not trainer.sanity_checking:
                    self._loader(trainer, "val", trainer.val_dataloaders)

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                self._batch(trainer, "train", batch, batch_idx)
                probe._draws.step(pl_module, int(trainer.current_epoch), int(batch_idx))
                probe._draws.enter()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                probe._draws.leave()

            def on_exception(self, trainer, pl_module, exception):
                probe._draws.leave()

            def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
                if not trainer.sanity_checking:
                    self._batch(trainer, "val", batch, batch_idx, dataloader_idx)

        return Fingerprints()

    def count_train_stream(self, recorder) -> None:
        """Once, before the first train epoch iterates: how many items the rank's stream yields
        (a hung world keeps it; uneven shards show even when the run caps the epoch)."""
        from torch.utils.data import DataLoader, IterableDataset

        loader = self._loaders.get("train")
        if "train" in self._streams or not isinstance(loader, DataLoader) \
                or not isinstance(loader.dataset, IterableDataset):
            return
        self._streams.add("train")
        recorder.emit({"ev": "ds_stream", "stage": "train", "n": count_stream(loader.dataset)})

    def collect(self, loaded, trainer, recorder):
        from torch.utils.data import DataLoader, IterableDataset

        out = {}
        for stage, loader in self._loaders.items():
            if isinstance(loader, DataLoader) and isinstance(loader.dataset, IterableDataset):
                out[stage] = count_stream(loader.dataset)
        return {"stream_len": out}


# -- pytest side -------------------------------------------------------------------------------

def _user_frames(tb_text: str) -> list[dict]:
    from ..sites import is_user_file

    frames = []
    for m in re.finditer(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)', tb_text or ""):
        if is_user_file(m["file"]):
            frames.append({"file": m["file"], "line": int(m["line"]), "func": m["func"]})
    return frames


def _n_batches(n: int) -> str:
    return f"{n} batch{'' if n == 1 else 'es'}"


def _ranges(ids: list) -> str:
    """[0, 1, 2, 3, 8] -> '0-3, 8'."""
    parts, start, prev = [], None, None
    for i in ids:
        if start is None:
            start = prev = i
        elif isinstance(i, int) and i == prev + 1:
            prev = i
        else:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = i
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ", ".join(parts)


def _injection_failures(run: Run) -> list:
    """The ranks whose fit raised inside Lightning's re-creation of the DataLoader, or later in a
    sampler that expected attributes the injected DistributedSampler lacks (empty otherwise)."""
    if run.finished:
        return []
    failed = [r for r in run.job.ranks if r.status == "error" and r.traceback]
    if not failed:
        return []
    tb = failed[0].traceback
    message = failed[0].message or ""
    inside = any(fn in tb for fn in ("_update_dataloader", "_dataloader_init_kwargs_resolve_sampler",
                                     "_get_dataloader_init_args_and_kwargs", "_reinstantiate_wrapped_cls"))
    missing_attr = "DistributedSampler" in message and "has no attribute" in message
    return failed if inside or missing_attr else []


def _missing_attribute(first, stage: str, message: str, frames: list[dict]):
    """(where, cause, fix, evidence) for a sampler reading what the DistributedSampler lacks."""
    where = fmt_site(frames[-1])
    cause = (f"a sampler or batch sampler of the {stage} DataLoader reads an attribute that the "
             f"DistributedSampler Lightning injects does not have ({first.exc_type}: {message})")
    evidence = [Evidence(f"{first.exc_type}: {message}", rank=first.rank, site=where)]
    fix = ("read only what every sampler offers (a DistributedSampler keeps the dataset as .dataset, not "
           ".data_source; use len(sampler) and iteration), or own the sampling: "
           "Trainer(use_distributed_sampler=False) with a batch sampler that shards by rank itself.")
    return where, cause, fix, evidence


def _not_recreatable(first, stage: str, message: str, created: list[dict]) -> tuple[str, str]:
    """(cause, fix) for a DataLoader Lightning could not re-create with its sampler."""
    cause = (f"Lightning could not re-create the {stage} DataLoader with its DistributedSampler "
             f"({first.exc_type}: {message})")
    positional = [c for c in created if (c.get("positional") or 0) >= 4]
    if positional:
        # DataLoader(dataset, batch_size, shuffle, sampler, ...): the sampler is its 4th argument.
        cause += (f"; the DataLoader gets its sampler positionally (its 4th argument, of "
                  f"{positional[0]['positional']} given by position), so the re-created DataLoader would receive "
                  f"it twice")
    fix = ("pass DataLoader arguments by keyword (DataLoader(dataset, batch_size=..., sampler=...)), "
           "and keep a DataLoader subclass's __init__ arguments stored as attributes of the same name; "
           "or own the sampling with Trainer(use_distributed_sampler=False) and a rank-aware sampler.")
    return cause, fix


def _compare_fingerprints(per_rank: dict, world_size: int) -> tuple[int, int, set]:
    """(steps with the same batch on every rank, steps compared, sample hashes of the same ones),
    step by step over rank 0's epochs."""
    same = compared = 0
    samples = set()
    if world_size < 2:
        return 0, 0, samples  # one rank has nobody to repeat
    for epoch in sorted(per_rank[0]):
        lists = [per_rank[r].get(epoch, []) for r in range(world_size)]
        for k in range(min(len(x) for x in lists)):
            fps = [lst[k].get("fp") for lst in lists]
            if None in fps:
                continue
            compared += 1
            if len(set(fps)) == 1:
                same += 1
                samples.update(lists[0][k].get("rows", []))
    return same, compared, samples


def _completed_epochs(run: Run) -> dict[int, set]:
    """rank -> the epochs whose train loop that rank finished: every epoch of a rank that finished,
    else those before the last epoch it recorded and those it reached on_train_epoch_end in."""
    out = {}
    for r in range(run.world_size):
        events = [e for e in run.events(r) if "epoch" in e and not e.get("sanity")]
        seen = {e["epoch"] for e in events}
        if run.job.ranks[r].status == "ok":
            out[r] = seen
            continue
        last = max(seen, default=-1)
        ended = {e["epoch"] for e in events if e.get("ev") == "hook" and str(e.get("name", "")).endswith(
            "on_train_epoch_end")}
        out[r] = {ep for ep in seen if ep < last} | ended
    return out


def _draw_uses(run: Run) -> dict[str, dict]:
    """user file:line -> {"use": "input" | "combined", "op": the op that decided}: how the draws
    made there are used. "input" only when every decided draw of that line, on every rank, reached
    an op with weights alone (the draw is itself the sample, a GAN's latent); one draw combined
    with the rank's data (noise on a VAE's mean, a dropout mask) makes the line "combined"."""
    out: dict = {}
    for r in range(run.world_size):
        sites = {e.get("id"): fmt_site(e["site"]) for e in run.events(r, "ds_draw") if e.get("site")}
        for e in run.events(r, "ds_draw_use"):
            where = sites.get(e.get("id"))
            if where is None:
                continue
            known = out.setdefault(where, {"use": e.get("use"), "op": e.get("op")})
            if e.get("use") == "combined":
                known.update(use="combined", op=e.get("op"))
    return out


def _draws_by_site(run: Run) -> dict[str, dict[int, dict[tuple, list]]]:
    """user file:line -> rank -> (epoch, batch_idx) -> value hashes of the draws made there."""
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in range(run.world_size):
        for e in run.events(r, "ds_draw"):
            if e.get("site") and e.get("key"):
                out[fmt_site(e["site"])][r][tuple(e["key"])].append(e.get("hash"))
    return out


def _index_groups(run: Run, rank: int) -> dict[tuple, list[list]]:
    """(stage, epoch) -> the key groups ``rank``'s fetches received, of the first dataset that
    stage fetched from (a second loader of the stage is not dataloader 0's)."""
    first: dict = {}
    out: dict = defaultdict(list)
    for e in run.events(rank, "ds_index"):
        stage = e.get("stage")
        if first.setdefault(stage, e.get("ds")) == e.get("ds"):
            out[(stage, e.get("epoch", 0))].append(e.get("keys") or [])
    return out


def _items_into_batches(run: Run, rank: int, out: dict) -> None:
    """Give ``rank``'s batches of an IterableDataset the items its iterators yielded: batch k
    came from worker k % workers, as its (k // workers)-th chunk of batch_size items (the order
    in which a DataLoader hands out the workers' batches)."""
    import hashlib

    per: dict = defaultdict(lambda: defaultdict(list))
    workers: dict = {}
    for e in run.events(rank, "ds_item"):
        key = (e.get("stage"), e.get("epoch", 0))
        per[key][e.get("w", 0)].append(e.get("h"))
        workers[key] = max(1, int(e.get("nw") or 1))
    sizes = {e.get("stage"): e.get("batch_size") or 1 for e in run.events(rank, "ds_loader")}
    for (stage, epoch), by_worker in per.items():
        nw, bs = workers[(stage, epoch)], sizes.get(stage, 1)
        for k, event in enumerate(out.get(stage, {}).get(rank, {}).get(epoch, [])):
            chunk = by_worker.get(k % nw, [])[(k // nw) * bs:(k // nw + 1) * bs]
            if chunk:
                event.update(n=len(chunk), rows=chunk[:ROWS_PER_BATCH], src="item",
                             fp=hashlib.blake2b(repr(chunk).encode(), digest_size=8).hexdigest())
                event.pop("ids", None)  # integers in an item are not its identity


def _from_keys(keys: list) -> dict:
    """The fields of a batch event whose samples are the dataset keys ``keys``."""
    import hashlib

    out = {"n": len(keys), "rows": [str(k) for k in keys[:ROWS_PER_BATCH]], "src": "index",
           "fp": hashlib.blake2b(repr(keys).encode(), digest_size=8).hexdigest()}
    if all(isinstance(k, int) for k in keys):
        out["ids"] = keys[:ROWS_PER_BATCH]
    return out


_STEP_OF = {"train": ("training_step",), "val": ("validation_step",)}


def _split_note(stage: str, read: dict) -> str:
    """The note of a stage whose identical batches are split by rank inside the step."""
    return (f"every rank draws the same {stage} batches by design: {describe(read)}, so the split between ranks "
            f"happens inside the step, which this check does not see (it fingerprints the DataLoader's batches, "
            f"not the rows each rank then keeps).")


def _gate_evidence(read: dict, reads: list[list[dict]]) -> Evidence:
    """A rank read that only decides what runs, on the ranks that made it (None: all)."""
    ranks = [r for r, events in enumerate(reads)
             if any(e.get("site") == read.get("site") and e.get("hook") == read.get("hook") for e in events)]
    return Evidence(f"{describe(read, where=False)}, so it does not split the batch",
                    rank=ranks[0] if len(ranks) == 1 else None, site=fmt_site(read.get("site")))


def _counted_as(events: list[dict], loader: dict | None) -> tuple[str, str]:
    """What a batch's count is, as (unit of the distinct count, template of the sizes): the
    dataset keys its fetches received are samples; an iterable dataset's items are what it yields
    (with batch_size=None each is a ready-made batch); tensor rows are not samples."""
    srcs = {e.get("src") for e in events}
    if srcs == {"index"}:
        return "samples", "of sizes {}"
    if srcs == {"item"}:
        whole = loader is not None and "batch_size" in loader and loader.get("batch_size") is None
        return "dataset items", ("of {} dataset items (each a ready-made batch the dataset yields: batch_size=None)"
                                 if whole else "of {} dataset items")
    where = f" in {loader['type']}" if loader and loader.get("type") else ""
    return f"tensor rows (dataset items cannot be counted{where})", "of {} tensor rows (not samples)"


def _returned_site(run: Run, hook: str) -> dict | None:
    """Where the loader ``hook`` returned was constructed (a loader built before the hooks ran,
    in the target factory or ``setup``), from the ranks' ``loader_built`` events."""
    for r in range(run.world_size):
        for e in run.events(r, "loader_built"):
            if e.get("hook") == hook and e.get("loaders") and e["loaders"][0].get("site"):
                return e["loaders"][0]["site"]
    return None


def _not_torch_loader(loader: dict | None) -> bool:
    """The stage's loader is not a torch DataLoader (a package's own loader class)."""
    built = (loader or {}).get("built") or {}
    return bool(loader) and "dataset" not in loader and built.get("torch_loader") is False


def _batch_fp(train: dict, rank: int, key: tuple) -> str | None:
    """The fingerprint of ``rank``'s train batch ``key`` = (epoch, batch_idx), if recorded."""
    epoch, idx = key
    return next((e.get("fp") for e in train.get(rank, {}).get(epoch, []) if e.get("idx") == idx), None)


class DataSharding(Contract):
    id = "data-sharding"
    title = "Each rank trains on its own share of the data, reshuffled every epoch"
    rule_section = "Sampling, metrics and writes"
    strategies = ("ddp", "fsdp", "deepspeed")
    probe_class = DataShardingProbe

    def blames(self, run: Run) -> int | None:
        """The ranks ran different hooks first because their own dataloaders give them different
        numbers of batches; hooks that differ because a rank stopped or hangs are not claimed. A fit
        that Lightning's sampler injection stopped (a DataLoader it cannot re-create) is this
        contract's failure on every strategy, not the user's code stopping nor a sharded tier's."""
        if _injection_failures(run):
            return Blame.RAISED
        if run.divergence_kind() == "hooks" and self._uneven_counts(run, self._batches(run), self._loaders(run)):
            return Blame.DATA
        return super().blames(run)

    def judge(self, run: Run) -> Verdict:
        recreate = self._recreate_failure(run)
        if recreate is not None:
            return recreate
        batches = self._batches(run)
        loaders = self._loaders(run)
        findings: list[Verdict] = []
        split: dict[str, dict] = {}
        findings += self._identical_across_ranks(run, batches, loaders, split)
        findings += self._replayed_within_rank(run, batches, loaders)
        findings += self._uneven_counts(run, batches, loaders)
        findings += self._same_order_every_epoch(run, batches, loaders)
        findings += self._identical_noise(run, batches)
        if findings:
            first = merged(findings, [_split_note(stage, read) for stage, read in split.items()])
            if not run.finished:
                first.notes.append("the world did not finish; the batches each rank recorded up to then are "
                                   "the evidence (the item's report says where each rank was).")
            return first
        unread = self._unreadable(run, batches, loaders)
        if unread is not None:
            return unread
        return self._passed(run, batches, loaders, split)

    def _unreadable(self, run: Run, batches, loaders) -> Verdict | None:
        """Not judged when train batches ran but no rank's samples could be told apart: no dataset
        key was read at the source and no batch had a tensor to fingerprint."""
        train = batches.get("train", {})
        events = [e for r in train.values() for ep in r.values() for e in ep]
        if not events or any(e.get("fp") for e in events):
            return None
        loader = loaders.get("train") or {}
        what = f"{loader.get('type') or 'the train loader'} over {self._what(loader)}"
        return self.not_judged(f"cannot tell samples apart in {what}: its fetches hand the "
                                       f"dataset no keys this check can read and its batches hold no tensors, "
                                       f"so nothing was compared across ranks.")

    # -- data ----------------------------------------------------------------------------------
    @staticmethod
    def _batches(run: Run) -> dict[str, dict[int, dict[int, list[dict]]]]:
        """stage -> rank -> epoch -> batch events (dataloader 0), in order. Where the rank recorded
        the dataset keys of its fetches, a batch's samples are those keys (``src`` "index"), not
        rows of its tensors: a collated graph's atoms or a loader's positions are not samples."""
        out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
        for r in range(run.world_size):
            for e in run.events(r, "batch"):
                if e.get("dl", 0) == 0:
                    out[e["stage"]][r][e.get("epoch", 0)].append(dict(e))
            for (stage, epoch), groups in _index_groups(run, r).items():
                for event, keys in zip(out.get(stage, {}).get(r, {}).get(epoch, []), groups):
                    event.update(_from_keys(keys))
            _items_into_batches(run, r, out)
        return out

    @staticmethod
    def _loaders(run: Run) -> dict[str, dict]:
        """stage -> the first loader event of rank 0 (or any rank)."""
        out = {}
        for r in range(run.world_size):
            for e in run.events(r, "ds_loader"):
                out.setdefault(e["stage"], e)
        return out

    @staticmethod
    def _what(loader: dict | None) -> str:
        if _not_torch_loader(loader):
            return f"{loader['type']} (not a torch DataLoader)"
        if not loader or not loader.get("dataset"):
            return "the DataLoader"
        kind = "IterableDataset" if loader.get("iterable") else "dataset"
        return f"{kind} {loader['dataset']}"

    @staticmethod
    def _dataset_site(loader: dict | None) -> str | None:
        if not loader:
            return None
        site = (loader.get("built") or {}).get("site") or loader.get("created_at") or loader.get("dataset_site")
        return fmt_site(site) if site else None

    def _fix_for(self, loader: dict | None) -> str:
        if _not_torch_loader(loader):
            site = self._dataset_site(loader)
            return (f"{loader['type']}{f' (built at {site})' if site else ''} is not a torch DataLoader, so "
                    f"Lightning injects no DistributedSampler into it: split the samples by rank inside "
                    f"{loader['type']} (each rank takes indices rank, rank + world_size, ... from "
                    f"torch.distributed, reshuffled per epoch), or return a torch DataLoader over the same dataset "
                    f"from the hook so that Lightning shards it.")
        if loader and loader.get("iterable"):
            return (f"shard the stream inside {loader.get('dataset')}.__iter__: keep item i only when "
                    f"i % (world_size * num_workers) == rank * num_workers + worker_id (rank and world size "
                    f"from torch.distributed, worker_id and num_workers from torch.utils.data.get_worker_info()), "
                    f"or use a map-style Dataset so that Lightning injects a DistributedSampler.")
        if loader and not loader.get("use_distributed_sampler", True):
            return ("with use_distributed_sampler=False the sampler is yours: give it the rank and world size "
                    "(e.g. DistributedSampler(dataset, num_replicas=trainer.world_size, rank=trainer.global_rank)) "
                    "or drop use_distributed_sampler=False so that Lightning injects one.")
        return "make each rank draw a disjoint share of the samples (a DistributedSampler or rank-aware sampler)."

    # -- 1. DataLoader Lightning cannot re-create ------------------------------------------------
    def _recreate_failure(self, run: Run) -> Verdict | None:
        failed = _injection_failures(run)
        if not failed:
            return None
        tb = failed[0].traceback
        message = first_sentence(failed[0].message) or "no message"
        m = re.search(r"(train|val|test|predict)_dataloader", tb)
        stage = m.group(1) if m else "train"
        created = [e for e in self._creation_events(run) if (e.get("hook") or "").endswith(f"{stage}_dataloader")] \
            or self._creation_events(run)
        built = created[0]["site"] if created else _returned_site(run, f"{stage}_dataloader")
        built_at = fmt_site(built) if built else None
        frames = _user_frames(tb)
        if "has no attribute" in (failed[0].message or "") and frames:
            where, cause, fix, evidence = _missing_attribute(failed[0], stage, message, frames)
        else:
            where = built_at or (fmt_site(frames[-1]) if frames else None)
            cause, fix = _not_recreatable(failed[0], stage, message, created)
            evidence = []
        for r in failed:
            evidence.append(Evidence(f"fit raised {r.exc_type} inside Lightning's sampler injection "
                                     f"({stage}_dataloader), before the first {stage} batch", rank=r.rank))
        if built_at:
            evidence.append(Evidence(f"the {stage} DataLoader is built here", site=built_at))
        ranks = "every rank" if len(failed) == run.world_size else f"rank(s) {[r.rank for r in failed]}"
        summary = f"{cause}. Fit fails on {ranks} at {where or 'the DataLoader construction'}."
        return self.verdict("failed", summary, evidence=evidence, fix=fix)

    def _creation_events(self, run: Run) -> list[dict]:
        return [e for r in range(run.world_size) for e in run.events(r, "ds_created")][:4]

    # -- 2. identical data on every rank ---------------------------------------------------------
    def _identical_across_ranks(self, run, batches, loaders, split: dict) -> list[Verdict]:
        """Stages whose batches are the same on every rank; a stage whose step selects its rows by
        rank on every rank (``split``: stage -> rank 0's read) is split inside the step instead."""
        out = []
        reads = [run.events(r, "rank_read") for r in range(run.world_size)]
        # Training only: validation batches repeated on every rank are duplicated evaluation,
        # judged by eval-duplication against the single-device values (often harmless: a set
        # smaller than the world is evaluated whole on every rank on purpose).
        for stage in ("train",):
            per_rank = batches.get(stage, {})
            if len(per_rank) < run.world_size:
                continue
            same, compared, samples = _compare_fingerprints(per_rank, run.world_size)
            if compared and same == compared:
                selecting = selecting_reads(reads, _STEP_OF[stage])
                if selecting:
                    split[stage] = selecting[0]
                    continue
                verdict = self._identical(run, stage, per_rank, loaders.get(stage), same, compared, samples)
                gates = gating_reads(reads, _STEP_OF[stage])[:2]
                if gates:
                    verdict.evidence += [_gate_evidence(read, reads) for read in gates]
                    verdict.fix += (f" If every rank is meant to get the same batches, select this rank's rows "
                                    f"inside {gates[0].get('hook')} (e.g. rows[self.global_rank::world_size]).")
                out.append(verdict)
        return out

    def _identical(self, run, stage, per_rank, loader, same, compared, samples) -> Verdict:
        """Every rank drew the same batches of ``stage``: which, and why the loader is not sharded."""
        steps = {r: {ep: len(v) for ep, v in per_rank[r].items()} for r in range(run.world_size)}
        first_ep = min(per_rank[0])
        firsts = {r: per_rank[r].get(first_ep, [])[:4] for r in range(run.world_size)}
        ranks = " and ".join(f"rank {r}" for r in range(run.world_size))
        every = "in every step" if same == compared else f"in {same} of {compared} steps"
        ids = [i for e in per_rank[0][first_ep] for i in e.get("ids", [])]
        id_text = f"; sample ids {_ranges(ids)} in the same order on every rank" if ids else ""
        srcs = {e.get("src") for e in per_rank[0][first_ep]}
        how = {"index": "batches compared by the dataset indices they fetched",
               "item": "batches compared by the items the dataset's iterator yielded"}.get(
            srcs.pop() if len(srcs) == 1 else None, "fingerprinted batches")
        unit, sizes = _counted_as(per_rank[0][first_ep], loader)
        summary = (f"{ranks} drew identical {stage} batches {every} ({compared} {how}, "
                   f"{len(samples)} distinct {unit}{id_text}), so the world trains on one rank's data "
                   f"{run.world_size} times; {self._what(loader)} is not sharded by rank.")
        evidence = [Evidence(f"{stage} epoch {first_ep}: {_n_batches(steps[r].get(first_ep, 0))} "
                             + sizes.format([e.get('n') for e in per_rank[r].get(first_ep, [])]) + ", batch hashes "
                             f"{[(e.get('fp') or 'none')[:8] for e in firsts[r]]}"
                             + (f", sample ids {[e.get('ids') for e in firsts[r]]}" if ids else ""), rank=r)
                    for r in range(run.world_size)]
        evidence += self._loader_evidence(run, stage, loader, steps[0][first_ep])
        return self.verdict("failed", summary, evidence=evidence, fix=self._fix_for(loader), category="silent")

    def _loader_evidence(self, run, stage, loader, have: int) -> list[Evidence]:
        """For a stream: the items every rank yields against the steps a sharded stream would give."""
        stream = self._stream_len(run, stage)
        if loader and loader.get("iterable") and stream and loader.get("batch_size"):
            want = math.ceil(stream / (loader["batch_size"] * run.world_size))
            capped = " (the run caps an epoch at 4 batches)" if have >= 4 and want < have else ""
            evidence = [Evidence(
                f"{self._what(loader)} yields all {stream} items on each rank: {have} steps per rank "
                f"per epoch{capped} where {stream} items / ({loader['batch_size']} per batch x "
                f"{run.world_size} ranks) = {want}", site=self._dataset_site(loader))]
            if loader.get("dataset_site"):
                evidence.append(Evidence(f"{loader['dataset']} is defined here; its __iter__ yields the "
                                         f"same items on every rank" if not loader.get("num_workers")
                                         else f"{loader['dataset']} is defined here",
                                         site=fmt_site(loader["dataset_site"])))
            return evidence
        if _not_torch_loader(loader):
            return [Evidence(f"the {stage} {loader['type']} is built here; it is not a torch DataLoader, so Lightning "
                             f"injects no DistributedSampler into it", site=self._dataset_site(loader))]
        if loader:
            return [Evidence(f"{self._what(loader)}, sampler {loader.get('sampler')}, "
                             f"use_distributed_sampler={loader.get('use_distributed_sampler')}",
                             site=self._dataset_site(loader))]
        return []

    @staticmethod
    def _stream_len(run: Run, stage: str) -> int | None:
        for data in run.probe("data-sharding"):
            if data and data.get("stream_len", {}).get(stage):
                return data["stream_len"][stage]
        return None

    # -- 3. the same samples several times on one rank -------------------------------------------
    def _replayed_within_rank(self, run, batches, loaders) -> list[Verdict]:
        out = []
        if (loaders.get("train") or {}).get("replacement"):
            return out  # sampling with replacement repeats samples by design
        for stage in ("train",):
            for r, epochs in sorted(batches.get(stage, {}).items()):
                for epoch, events in sorted(epochs.items()):
                    rows = [h for e in events for h in e.get("rows", [])]
                    if len(rows) < 2:
                        continue
                    repeats = len(rows) - len(set(rows))
                    if repeats * 4 >= len(rows):  # a quarter or more of the rows seen before
                        loader = loaders.get(stage) or {}
                        workers = loader.get("num_workers", 0)
                        why = (f" (DataLoader num_workers={workers}: each worker replays the stream)"
                               if workers and loader.get("iterable") else "")
                        unit = _counted_as(events, loader)[0]
                        summary = (f"rank {r} saw {repeats} of its {len(rows)} {stage} {unit} more "
                                   f"than once in epoch {epoch}{why}; {self._what(loader)} does not split the work "
                                   f"between workers/ranks.")
                        out.append(self.verdict("failed", summary, category="silent", fix=self._fix_for(loader),
                                                evidence=[Evidence(f"epoch {epoch}: {len(rows)} {unit}, "
                                                                   f"{len(set(rows))} distinct", rank=r,
                                                                   site=self._dataset_site(loader))]))
                        return out
        return out

    # -- 4. different numbers of batches ---------------------------------------------------------
    def _uneven_counts(self, run, batches, loaders) -> list[Verdict]:
        """Ranks whose train DataLoaders differ in length (len() per rank, or the counted stream),
        or, without either, differ in the batches they ran over epochs every rank completed. A
        rank that stopped early or hangs in a collective is not a data fault."""
        streams = self._stream_batches(run)
        if len(set(streams.values())) > 1:
            return [self._uneven(run, loaders, 0, streams, "stream")]
        for epoch in sorted({e.get("epoch", 0) for r in range(run.world_size) for e in run.events(r, "ds_loader")}):
            lengths = self._lengths(run, epoch)
            if len(set(lengths.values())) > 1:
                return [self._uneven(run, loaders, epoch, lengths, "len")]
        per_rank = batches.get("train", {})
        done = _completed_epochs(run)
        for epoch in sorted({ep for r in per_rank for ep in per_rank[r]}):
            if not all(epoch in done[r] for r in range(run.world_size)):
                continue  # a rank still running, stuck or dead in this epoch may only be behind
            counts = {r: len(per_rank.get(r, {}).get(epoch, [])) for r in range(run.world_size)}
            if len(set(counts.values())) > 1 and not streams and not self._lengths(run, epoch):
                return [self._uneven(run, loaders, epoch, counts, "ran")]
        return []

    @staticmethod
    def _stream_batches(run: Run) -> dict[int, int]:
        """rank -> batches per epoch of a train IterableDataset, from the items counted on each
        rank before training; {} unless every rank has one."""
        streams = {}
        for r in range(run.world_size):
            n = next((e.get("n") for e in run.events(r, "ds_stream") if e.get("stage") == "train"), None)
            loader = next(iter(run.events(r, "ds_loader")), {})
            if n is not None and loader.get("batch_size"):
                bs = loader["batch_size"]
                streams[r] = n // bs if loader.get("drop_last") else math.ceil(n / bs)
        return streams if len(streams) == run.world_size else {}

    @staticmethod
    def _lengths(run: Run, epoch: int) -> dict[int, int]:
        """rank -> len(train DataLoader) recorded at the start of ``epoch``; {} unless every rank has one."""
        out = {}
        for r in range(run.world_size):
            for e in run.events(r, "ds_loader"):
                if e.get("stage") == "train" and e.get("epoch", 0) == epoch and e.get("length") is not None:
                    out[r] = e["length"]
        return out if len(out) == run.world_size else {}

    def _uneven(self, run, loaders, epoch: int, counts: dict, how: str) -> Verdict:
        loader = loaders.get("train") or {}
        text = ", ".join(f"rank {r}: {_n_batches(c)}" for r, c in counts.items())
        measured = {"ran": f"ranks ran different numbers of train batches in epoch {epoch} ({text})",
                    "len": f"len(train DataLoader) differs across ranks in epoch {epoch} ({text})",
                    "stream": f"the train IterableDataset yields a different number of batches on each rank "
                              f"({text}: the items each rank's stream yields, divided by the batch size)"}[how]
        capped = (" The conformance run caps an epoch at 4 batches, which hides the difference in the run "
                  "itself; production runs every batch." if how != "ran" and min(counts.values()) >= 4 else "")
        summary = (f"{measured}; each training step all-reduces gradients, so the extra step pairs "
                   f"with another rank's next collective or waits forever. {self._what(loader)} gives the "
                   f"ranks unequal shares.{capped}")
        site = self._dataset_site(loader)
        evidence = [Evidence(f"epoch {epoch}: {_n_batches(c)}" + (" per epoch" if how != "ran" else ""),
                             rank=r, site=site) for r, c in counts.items()]
        fix = ("give every rank the same number of batches: drop or pad the remainder "
               "(DistributedSampler(drop_last=True), or stop an IterableDataset on every rank after the "
               "smallest rank's item count), or let Lightning inject its sampler.")
        return self.verdict("failed", summary, evidence=evidence, fix=fix, category="deadlock")

    # -- 5. a shuffling sampler, batch sampler or dataset that is never reseeded -----------------
    @staticmethod
    def _order_source(loader: dict) -> tuple[str, str] | None:
        """(where the train order is shuffled: 'sampler', 'batch sampler' or 'dataset', its class)
        when the order is meant to change every epoch and nothing of Lightning's reseeds it."""
        if loader.get("iterable"):
            return ("dataset", loader.get("dataset") or "") if loader.get("dataset_shuffles") else None
        if loader.get("custom_batch_sampler") and loader.get("batch_sampler_shuffles"):
            return "batch sampler", loader["custom_batch_sampler"]
        if loader.get("use_distributed_sampler", True):
            return None  # Lightning's DistributedSampler, reseeded by Lightning every epoch
        sampler = loader.get("inner_sampler") or loader.get("sampler") or ""
        if sampler == "SequentialSampler" or (sampler == "DistributedSampler" and not loader.get("shuffle")):
            return None
        return "sampler", sampler

    def _same_order_every_epoch(self, run, batches, loaders) -> list[Verdict]:
        source = self._order_source(loaders.get("train") or {})
        if source is None:
            return []
        kind, name = source
        orders = self._sampler_orders(run, name)
        per_rank = batches.get("train", {})
        for r in range(run.world_size):
            epochs = sorted(per_rank.get(r, {}))
            if len(epochs) < 2:
                return []
            seqs = [[h for e in per_rank[r][ep] for h in e.get("rows", [])] for ep in epochs[:2]]
            if not seqs[0] or seqs[0] != seqs[1]:
                return []
            idx = orders.get(r)
            if idx is not None and idx == sorted(idx):
                return []  # a fixed, unshuffled order is a choice, not a missing reseed
        return [self._same_order(run, per_rank, kind, name, epochs[:2], orders)]

    def _same_order(self, run, per_rank, kind: str, name: str, epochs: list, orders: dict) -> Verdict:
        a, b = epochs
        if kind == "dataset":
            summary = (f"IterableDataset {name} yields every rank the same sample order in epoch {a} and epoch {b}: "
                       f"its __iter__ shuffles with a fixed seed, so every epoch repeats the same batches.")
            fix = ("shuffle with a seed that changes every epoch: keep an epoch counter on the dataset (incremented "
                   "in __iter__, or a set_epoch(epoch) called from on_train_epoch_start) and draw from "
                   "random.Random(seed + epoch) or torch.Generator().manual_seed(seed + epoch).")
        else:
            owner = "with use_distributed_sampler=False the train sampler" if kind == "sampler" \
                else "the train batch sampler"
            summary = (f"{owner} ({name}) gives every rank the same sample order in epoch {a} and epoch {b}: it is "
                       f"shuffled once and never reseeded (no set_epoch), so every epoch repeats the same batches.")
            fix = (f"reseed the permutation every epoch: implement set_epoch(epoch) on the {kind} (Lightning calls "
                   f"it at every epoch start) and draw from torch.Generator().manual_seed(seed + epoch), or use "
                   f"DistributedSampler(shuffle=True).")
        evidence = [Evidence(f"epochs {a} and {b}: identical sequence of "
                             f"{len([h for e in per_rank[r][a] for h in e.get('rows', [])])} sample hashes"
                             + (f"; {kind} order starts {orders[r][:8]}" if orders.get(r) else ""), rank=r)
                    for r in range(run.world_size)]
        for which in ("model", "datamodule"):
            cls = user_class(run, which)
            defined = class_site(cls, name) if cls is not None and name else None
            if defined:
                what = "its __iter__ shuffles with a fixed seed" if kind == "dataset" else \
                    "it draws its permutation once and has no set_epoch"
                evidence.append(Evidence(f"{name} is defined here: {what}", site=fmt_site(defined)))
                break
        return self.verdict("failed", summary, evidence=evidence, fix=fix, category="silent")

    @staticmethod
    def _sampler_orders(run: Run, cls: str) -> dict[int, list]:
        out = {}
        for r in range(run.world_size):
            for e in run.events(r, "ds_sampler"):
                if e.get("cls") == cls:
                    out.setdefault(r, e.get("indices"))
        return out

    # -- 6. random inputs drawn identically on every rank -----------------------------------------
    def _identical_noise(self, run, batches) -> list[Verdict]:
        """A user line in training_step whose torch random draws are the same on every rank at
        every recorded step (two or more) while the ranks' batches differ."""
        ws = run.world_size
        train = batches.get("train", {})
        uses = _draw_uses(run)
        for where, per_rank in _draws_by_site(run).items():
            if len(per_rank) < ws or uses.get(where, {}).get("use") != "input":
                continue  # noise combined with each rank's own data, or never fed on: not a sample
            steps = sorted(set.intersection(*(set(per_rank[r]) for r in range(ws))))
            if len(steps) < 2 or any(len({tuple(per_rank[r][k]) for r in range(ws)}) > 1 for k in steps):
                continue
            batch_fps = [{_batch_fp(train, r, k) for r in range(ws)} for k in steps]
            if any(len(fps) == 1 and None not in fps for fps in batch_fps) \
                    or not any(len(fps) == ws and None not in fps for fps in batch_fps):
                continue  # identical batches are judged as such; unknown batches prove nothing
            return [self._noise(run, where, steps, train)]
        return []

    def _noise(self, run, where: str, steps: list, train) -> Verdict:
        first = {r: next(e for e in run.events(r, "ds_draw") if fmt_site(e["site"]) == where)
                 for r in range(run.world_size)}
        fn, shape = first[0]["fn"], first[0]["shape"]
        op = _draw_uses(run).get(where, {}).get("op")
        summary = (f"{fn} at {where} in training_step draws the same values on every rank at every recorded step "
                   f"({len(steps)} steps compared, identical {shape} tensors on ranks "
                   f"{', '.join(str(r) for r in range(run.world_size))}) while the ranks' batches differ, and the "
                   f"draw is itself the model's input (it reaches {op} with only weights, no data of the rank): every "
                   f"rank's global RNG starts from the same seed and is consumed the same way, so the world repeats "
                   f"one rank's random input {run.world_size} times and more ranks add no new random samples.")
        evidence = []
        for r in range(run.world_size):
            hashes = [e["hash"][:8] for e in run.events(r, "ds_draw") if fmt_site(e["site"]) == where][:4]
            batch = [(_batch_fp(train, r, k) or "none")[:8] for k in steps[:4]]
            evidence.append(Evidence(f"{fn} value hashes {hashes} at steps {[tuple(k) for k in steps[:4]]} "
                                     f"(epoch, batch); batch hashes {batch}", rank=r, site=where))
        fix = ("draw the noise per rank: create a generator in setup(), e.g. self.noise = torch.Generator("
               "device=self.device).manual_seed(seed + self.global_rank), and pass generator=self.noise (for "
               "randn_like/rand_like: torch.randn(x.shape, generator=self.noise, device=x.device, dtype=x.dtype)); "
               "or reseed once with a rank offset, torch.manual_seed(seed + self.global_rank), in setup() after "
               "the model is built (DDP broadcasts the initial weights, so they stay identical).")
        return self.verdict("failed", summary, evidence=evidence, fix=fix, category="silent")

    # -- passed ----------------------------------------------------------------------------------
    def _passed(self, run: Run, batches, loaders, split: dict) -> Verdict:
        parts = []
        for stage in ("train", "val"):
            per_rank = batches.get(stage, {})
            if not per_rank:
                continue
            counts = ", ".join(f"rank {r}: {sum(len(v) for v in per_rank[r].values())}" for r in sorted(per_rank))
            if stage in split:
                parts.append(f"{stage} batches are the same on every rank ({counts} batches) and "
                             f"{split[stage].get('hook')} selects each rank's rows by rank")
                continue
            parts.append(f"{stage} batches differ across ranks ({counts} batches)")
        loader = loaders.get("train")
        what = f" ({self._what(loader)}, sampler {loader.get('sampler')})" if loader else ""
        summary = ("; ".join(parts) or "no batches were recorded") + \
            f"{what}; the same number of train batches per epoch on every rank."
        return self.verdict("passed", summary, notes=[_split_note(stage, read) for stage, read in split.items()]
                            + _combined_noise_notes(run), empty=not parts)


def _combined_noise_notes(run: Run) -> list[str]:
    """One note per user line whose draws are the same on every rank but meet each rank's own
    data: said, so that a pass does not hide what was seen."""
    notes = []
    for where, use in _draw_uses(run).items():
        per_rank = _draws_by_site(run).get(where, {})
        if use.get("use") != "combined" or len(per_rank) < run.world_size:
            continue
        steps = set.intersection(*(set(per_rank[r]) for r in range(run.world_size)))
        if steps and all(len({tuple(per_rank[r][k]) for r in range(run.world_size)}) == 1 for k in steps):
            notes.append(f"the random draws at {where} are the same on every rank, but each meets the rank's own "
                         f"data (in {use.get('op')}): noise on each rank's samples, not a sample of its own.")
    return notes


CONTRACT = DataSharding()
