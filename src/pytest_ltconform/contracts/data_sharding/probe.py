"""data-sharding, rank side: fingerprints of every batch, the dataset keys each fetch hands
``__getitem__``, what an iterable dataset yields, the random draws of the first training steps,
and each loader's sampler and order (see the package's docstring for what the verdict makes of
them). Runs inside the ranks of the traced fit.
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict

from ...events import TRACE_ERROR, Recorded, declare
from ...harness import batch_leaves, batch_size
from ...runs import Probe
from ...world.rank import current_context
from .. import fetches, loader_sites
from . import order


class LoaderEvent(Recorded):
    """A loader a stage iterates (``stage``, ``type``) with its dataset, sampler and batch sampler."""

    stage: str
    type: str


class DrawEvent(Recorded):
    """A random draw in user code (``fn``, ``site``) fingerprinted (``hash``, ``shape``, ``id``)."""

    fn: str
    site: dict | None
    key: str
    hash: str
    shape: list
    id: int


class DrawUseEvent(Recorded):
    """Draw ``id`` met an operation ``op`` that ``use`` s it."""

    id: int
    use: str
    op: str


class IndexEvent(Recorded):
    """Dataset indices a stage's loader fetched (``keys``) from dataset ``ds`` (``dataset`` its class)."""

    stage: str
    keys: list
    ds: int
    dataset: str


class ItemEvent(Recorded):
    """Items an IterableDataset yielded in ``stage``, on DataLoader worker ``w`` of ``nw``."""

    stage: str
    w: int
    nw: int


class CreatedEvent(Recorded):
    """A DataLoader built in user code (``site``, ``cls``, ``positional`` arguments, ``hook``)."""

    site: dict | None
    positional: int
    cls: str
    hook: str | None


class SamplerEvent(Recorded):
    """A sampler (``cls``) iterated: the ``indices`` it gave and whether the global RNG moved (``rng``)."""

    cls: str
    indices: list
    rng: bool


class BatchEvent(Recorded):
    """A batch a stage received (``idx``, dataloader ``dl``) with its fingerprint's keys."""

    stage: str
    idx: int
    dl: int


class GlobalDrawEvent(Recorded):
    """User code drew from a global generator outside the steps (``fn``, ``site``, ``hook``):
    what may have drawn a split or subset per rank."""

    fn: str
    site: dict | None
    hook: str


class StreamEvent(Recorded):
    """How many items a train IterableDataset streams (``n``)."""

    stage: str
    n: int | None


class PlaceEvent(Recorded):
    """Where this rank sits in a world of several nodes: its ``node`` and ``local_rank``."""

    node: int
    local_rank: int


DS_LOADER = declare("ds_loader", LoaderEvent)
DS_DRAW = declare("ds_draw", DrawEvent)
DS_DRAW_USE = declare("ds_draw_use", DrawUseEvent)
DS_INDEX = declare("ds_index", IndexEvent)
DS_ITEM = declare("ds_item", ItemEvent)
DS_CREATED = declare("ds_created", CreatedEvent)
DS_SAMPLER = declare("ds_sampler", SamplerEvent)
BATCH = declare("batch", BatchEvent)
DS_STREAM = declare("ds_stream", StreamEvent)
DS_GLOBAL_DRAW = declare("ds_global_draw", GlobalDrawEvent)
DS_PLACE = declare("ds_place", PlaceEvent)

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


def _per_class(fn):
    """``fn(cls)`` computed once per class in this rank (reading a class's source parses its
    file); an unhashable class (a metaclass defining ``__eq__`` alone) is computed each time."""
    cache: dict = {}

    @functools.wraps(fn)
    def once(cls):
        try:
            if cls not in cache:
                cache[cls] = fn(cls)
            return cache[cls]
        except TypeError:
            return fn(cls)

    return once


@_per_class
def _class_site(cls) -> dict | None:
    """Where ``cls`` is defined (``{"file", "line", "func"}``), or None. Cached: finding a class's
    line parses its whole file, once per loader and stage otherwise."""
    import inspect

    try:
        lines, line = inspect.getsourcelines(cls)
        return {"file": inspect.getsourcefile(cls), "line": line, "func": cls.__qualname__}
    except (TypeError, OSError):
        return None


def _loader_info(trainer, stage: str, loader) -> dict:
    from torch.utils.data import DataLoader, IterableDataset

    info = {"ev": DS_LOADER, "stage": stage, "type": type(loader).__name__}
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
        info["order_owners"] = order.owners(loader)
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


@_per_class
def _shuffles_in_iter(cls) -> bool:
    """Whether a user IterableDataset's __iter__ (or what it calls on the class) shuffles. Only a
    user's class is read (torch's BatchSampler, on every loader, is not parsed)."""
    import inspect

    from ...sites import is_user_file

    try:
        path = inspect.getsourcefile(cls)
        if not (path and is_user_file(path)):
            return False
        source = inspect.getsource(cls)
    except (TypeError, OSError):
        return False
    return bool(re.search(r"shuffle|randperm|permutation", source))


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


def _rng_or_none():
    try:
        return order.rng_state()
    except Exception:
        return None


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

    from ...sites import is_user_file

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
# Index draws (a permutation, a subset): recorded only outside the steps, where they decide which
# samples each rank reads (torch.utils.data.random_split draws with torch.randperm).
INDEX_DRAWS = ("randperm", "randint", "multinomial", "bernoulli")
GLOBAL_DRAWS = {"random": ("random", "shuffle", "sample", "choice", "choices", "randint", "randrange", "uniform"),
                "numpy.random": ("permutation", "shuffle", "choice", "rand", "randn", "randint", "random")}


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
        self.outside: set = set()  # (file, line, hook) of draws recorded outside the steps

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
            self.recorder.emit({"ev": DS_DRAW_USE, "id": draw_id, "use": use, "op": name})
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
        """Patch the random functions before the user's module is imported (it may import them by
        name): torch's factories and in-place samplers (followed inside training_step), and the
        index draws of torch, random and numpy (recorded where user code makes them outside a step,
        with the global generator: a split or subset drawn per rank)."""
        import importlib

        import torch

        for name in RANDOM_FACTORIES + INDEX_DRAWS:
            if hasattr(torch, name):
                self.recorder.patch(torch, name, lambda original, n=name: self._wrap(original, f"torch.{n}"))
        # random_split draws with the randperm torch.utils.data.dataset imported by name
        dataset_module = importlib.import_module("torch.utils.data.dataset")
        if hasattr(dataset_module, "randperm"):
            self.recorder.patch(dataset_module, "randperm", lambda original: self._wrap(original, "torch.randperm"))
        for name in RANDOM_METHODS:  # defined on torch._C.TensorBase: shadowed on torch.Tensor
            self.recorder.patch(torch.Tensor, name, lambda original, n=name: self._wrap(original, f"Tensor.{n}"),
                                inherited=True)
        for module, names in GLOBAL_DRAWS.items():
            try:
                owner = importlib.import_module(module)
            except ImportError:
                continue
            for name in names:
                if hasattr(owner, name):
                    self.recorder.patch(owner, name, lambda original, n=f"{module}.{name}": self._wrap(original, n))

    def _wrap(self, original, label: str):
        draws = self

        def wrapper(*args, **kwargs):
            out = original(*args, **kwargs)
            if draws.key is not None and not draws.busy:
                draws.record(label, out)
            elif draws.key is None and not draws.busy:
                draws.outside_step(label, kwargs)
            return out

        return wrapper

    def outside_step(self, label: str, kwargs: dict) -> None:
        """One ``ds_global_draw`` event per user line and hook that draws from a global generator
        outside the steps (the module's construction, setup, a loader hook): a draw that decides
        which samples a rank reads is judged under per-rank seeds (seeding "both")."""
        import torch

        from ...sites import user_site

        if label.startswith(("torch.", "Tensor.")) and label.split(".", 1)[1] not in INDEX_DRAWS:
            return  # a tensor of random values (a layer's initial weights), not a choice of samples
        generator = kwargs.get("generator")
        if generator is not None and generator is not torch.default_generator:
            return  # a generator of the user's own: seeded as they chose
        self.busy = True
        try:
            trainer = self.recorder.trainer
            stage = getattr(getattr(trainer, "state", None), "stage", None)
            hook = self.recorder.current_hook() or "construction"
            # Trainer.fit enters the training stage before setup and the loader hooks run: a draw
            # there chooses samples; any other draw in the training stage is the loop's.
            if trainer is not None and getattr(stage, "value", None) == "train" and trainer.training \
                    and not any(h in hook for h in ("setup", "dataloader", "prepare_data")):
                return  # inside the training loop (a step's draws are followed by record())
            site, _ = user_site(3)
            if site is None:
                return
            key = (site.get("file"), site.get("line"), hook)
            if key not in self.outside:
                self.outside.add(key)
                self.recorder.emit(DS_GLOBAL_DRAW.new(fn=label, site=site, hook=hook))
        except Exception:
            pass  # a draw that cannot be placed is not recorded
        finally:
            self.busy = False

    def step(self, module, epoch: int, batch_idx: int) -> None:
        self.module, self.count = module, 0
        self.key = [epoch, batch_idx] if self.steps < DRAW_STEPS else None
        self.steps += 1

    def record(self, label: str, out) -> None:
        import hashlib

        import torch

        from ...sites import user_site

        if (not isinstance(out, torch.Tensor) or self.count >= DRAWS_PER_STEP or not label.startswith("torch.")
                or label.split(".", 1)[1] in INDEX_DRAWS
                or getattr(self.module, "_current_fx_name", None) != "training_step"):
            return
        self.busy = True
        try:
            site, _ = user_site(2)
            if site is not None:
                self.count += 1
                digest = hashlib.blake2b(_row_bytes(out.detach().reshape(-1)[:64]), digest_size=8).hexdigest()
                self.ids += 1
                self.recorder.emit({"ev": DS_DRAW, "fn": label, "site": site, "key": self.key, "hash": digest,
                                    "shape": list(out.shape), "id": self.ids})
                self._track(out, self.ids)
        except Exception:
            pass  # a fingerprint that cannot be taken is not recorded
        finally:
            self.busy = False


def _subset_chain(dataset) -> tuple[list, object]:
    """(the Subsets from ``dataset`` down, the dataset they select from): what random_split returns
    is a Subset of the whole dataset; [] and ``dataset`` itself when it is no Subset."""
    from torch.utils.data import Subset

    chain = []
    while isinstance(dataset, Subset) and len(chain) < 8:
        chain.append(dataset)
        dataset = dataset.dataset
    return chain, dataset


def _through_subsets(dataset, keys: list) -> list | None:
    """``keys`` of ``dataset`` as keys of the dataset its Subsets select from; None for no Subset."""
    chain, _ = _subset_chain(dataset)
    if not chain:
        return None
    try:
        for subset in chain:
            keys = [int(subset.indices[k]) for k in keys]
        return keys
    except Exception:
        return None


SPLIT_INDICES = 20_000     # a split's indices recorded in full up to this many (its hash beyond)


def split_info(dataset) -> dict | None:
    """What a loader's dataset selects from its whole: for a Subset (random_split's result, or a
    chain of them) the indices into the dataset underneath, resolved, with their hash and a digest
    of that dataset; for any other dataset its digest alone. Ranks that hold the same data have equal
    entries; an index list drawn with each rank's own seed differs."""
    import hashlib

    chain, base = _subset_chain(dataset)
    out = {"base": type(base).__qualname__, "base_digest": dataset_digest(base)}
    if chain:
        try:
            indices = None
            for subset in reversed(chain):  # the Subset nearest the whole dataset first
                indices = [int(i) for i in subset.indices] if indices is None else \
                    [indices[i] for i in subset.indices]
        except Exception:
            return out
        out.update(n=len(indices), indices_hash=hashlib.blake2b(repr(indices).encode(), digest_size=8).hexdigest())
        try:
            out["whole"] = len(base)
        except TypeError:
            pass
        if len(indices) <= SPLIT_INDICES:
            out["indices"] = indices
    return out


def dataset_digest(dataset) -> str | None:
    """A 64-bit digest of a dataset's own data (its tensors, arrays, lists and plain values, two
    levels down, large arrays by shape and a strided sample): equal on ranks that built the same
    data; None when nothing of it can be read. A number held as an object's attribute (``self.rank``,
    ``self.world_size``, a seed, a length) is configuration, not data, and is left out: a dataset
    that stores its rank holds the same data on every rank."""
    import hashlib

    h = hashlib.blake2b(digest_size=8)
    seen = [0]

    def feed(value, depth: int) -> None:
        import torch

        if seen[0] > 200_000:
            return
        seen[0] += 1
        if isinstance(value, torch.Tensor):
            flat = value.detach().reshape(-1)
            flat = flat if flat.numel() <= 1_000_000 else flat[:: max(1, flat.numel() // 100_000)]
            h.update(repr(tuple(value.shape)).encode() + _row_bytes(flat))
        elif type(value).__module__ == "numpy" and hasattr(value, "tobytes") and hasattr(value, "shape"):
            flat = value.reshape(-1)
            h.update(repr(value.shape).encode() + flat[:: max(1, flat.size // 100_000)].tobytes())
        elif isinstance(value, (str, bytes, int, float, bool)) or value is None:
            h.update(repr(value).encode()[:1000])
        elif depth < 3 and isinstance(value, (list, tuple)):
            h.update(f"[{len(value)}".encode())
            for item in value[:100_000]:
                feed(item, depth + 1)
        elif depth < 3 and isinstance(value, dict):
            for key in sorted(value, key=str)[:1000]:
                h.update(str(key).encode())
                feed(value[key], depth + 1)
        elif depth < 2 and isinstance(getattr(value, "__dict__", None), dict):
            feed({k: v for k, v in vars(value).items()
                  if not callable(v) and not isinstance(v, (int, float, bool))}, depth + 1)

    try:
        feed(dataset, 0)
    except Exception:
        return None
    return h.hexdigest() if seen[0] > 1 else None


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
            event = {"ev": DS_INDEX, "stage": stage, "keys": keys, "ds": id(it._dataset),
                     "dataset": type(it._dataset).__qualname__}
            base = _through_subsets(it._dataset, keys)
            if base is not None:
                event["base"] = base  # the keys of the dataset the Subsets select from
            self.recorder.emit(event)


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
        return {"ev": DS_ITEM, "stage": stage, "epoch": int(trainer.current_epoch),
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
        self._splits: set = set()

    def install(self, recorder) -> None:
        loader_sites.install(recorder)
        # Before the user's module is imported and built: draws at construction count, and names it
        # imports from torch, random or numpy are the recording ones.
        self._draws = _Draws(recorder)
        self._draws.install()

    def before_trainer(self, loaded, trainer_kwargs, recorder) -> None:
        import torch.utils.data as tud

        from ..rank_reads import RankReads, step_hook

        _Indices(recorder).install()
        _Items(recorder).install()
        reads = RankReads(recorder.emit, lambda: step_hook(recorder.trainer), recorder.current_hook)
        reads.install(loaded.ns, recorder)
        ctx = current_context()
        if ctx is not None and ctx.num_nodes > 1:  # where this rank sits: a split by the local rank repeats per node
            recorder.emit({"ev": DS_PLACE, "node": ctx.node_rank, "local_rank": ctx.local_rank})

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
                    recorder.emit({"ev": DS_CREATED, "site": site, "positional": len(args),
                                   "cls": type(loader).__name__, "hook": recorder.current_hook()})
                except Exception:
                    pass

            return __init__

        recorder.patch(tud.DataLoader, "__init__", factory)
        self._recorder = recorder
        trainer_kwargs["callbacks"] = list(trainer_kwargs.get("callbacks") or []) + \
            [self._callback(loaded.ns, recorder)]

    def watch_sampler(self, sampler) -> None:
        """Record the first indices each iteration of a user-defined sampler yields, whether the
        global random state moved until its first item (``rng``), and each call of its epoch
        methods (see :mod:`.order`)."""
        cls = type(sampler)
        if not order.is_user_class(cls):
            return
        recorder = self._recorder
        order.watch_epoch_methods(cls, recorder)
        if "__iter__" not in cls.__dict__:
            return

        def factory(original):
            def __iter__(obj):
                got, done, before, moved = [], False, _rng_or_none(), False
                try:
                    limit = max(1, min(ROWS_PER_BATCH, len(obj)))
                except Exception:
                    limit = ROWS_PER_BATCH
                for item in original(obj):
                    if not got:
                        moved = before is not None and _rng_or_none() not in (None, before)
                    if not done:
                        try:
                            got.append([int(i) for i in item] if isinstance(item, (list, tuple)) else int(item))
                        except Exception:
                            got.append(repr(item)[:40])
                        if len(got) >= limit:
                            recorder.emit({"ev": DS_SAMPLER, "cls": cls.__name__, "indices": got, "rng": moved})
                            done = True
                    yield item
                if not done:
                    moved = moved if got else before is not None and _rng_or_none() not in (None, before)
                    recorder.emit({"ev": DS_SAMPLER, "cls": cls.__name__, "indices": got, "rng": moved})

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
                for sampler in (*_samplers(loader), getattr(loader, "batch_sampler", None)):
                    if sampler is not None:
                        probe.watch_sampler(sampler)
                try:
                    info = _loader_info(trainer, stage, loader)
                    if stage not in probe._splits and hasattr(loader, "dataset"):
                        probe._splits.add(stage)  # once per stage: what the loader's dataset selects
                        info["split"] = split_info(loader.dataset)
                    recorder.emit({**info, "built": loader_sites.loader_of(f"{stage}_dataloader")})
                except Exception as exc:
                    recorder.emit({"ev": TRACE_ERROR, "where": "data-sharding loader", "error": repr(exc)})

            def _batch(self, trainer, stage, batch, batch_idx, dataloader_idx=0):
                key = (stage, int(trainer.current_epoch), dataloader_idx)
                self.seen[key] += 1
                event = {"ev": BATCH, "stage": stage, "idx": int(batch_idx), "dl": dataloader_idx}
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
        recorder.emit({"ev": DS_STREAM, "stage": "train", "n": count_stream(loader.dataset)})

    def collect(self, loaded, trainer, recorder):
        from torch.utils.data import DataLoader, IterableDataset

        from .. import production

        out = {}
        for stage, loader in self._loaders.items():
            if isinstance(loader, DataLoader) and isinstance(loader.dataset, IterableDataset):
                out[stage] = count_stream(loader.dataset)
        at_size = None
        if trainer.global_rank == 0 and isinstance(self._loaders.get("train"), DataLoader):
            try:  # every rank of the production world, computed from this rank's sampler
                at_size = production.plan(self._loaders["train"], loaded.user_kwargs, trainer.world_size)
            except Exception as exc:
                at_size = {"world": 0, "not_computed": f"{type(exc).__name__}: {exc}"}
        return {"stream_len": out, "production": at_size}


# -- pytest side -------------------------------------------------------------------------------
