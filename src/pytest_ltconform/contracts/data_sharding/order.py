"""data-sharding, rank side: who decides a train loader's sample order, and what reseeds it.

A DataLoader's order comes from its batch sampler (a user's one replaces the sampler), else from
its sampler, which Lightning may have wrapped (``DistributedSamplerWrapper`` around a user's
sampler) or replaced (``DistributedSampler``). Lightning 2.x reseeds by calling ``set_epoch(epoch)``
at every epoch start on ``loader.sampler`` and on ``loader.batch_sampler.sampler`` only
(``lightning.fabric.utilities.data._set_sampler_epoch``): never on a batch sampler itself, never
on a sampler its wrapper holds, never under another name.

Recorded here, per order owner: its class and role (``ds_loader["order_owners"]``), the methods of
its class that take an epoch (each call is a ``ds_epoch_call`` event with the caller's site), and
whether the global random state (torch, Python's ``random``, NumPy's legacy one) moved while its
``__iter__`` ran up to its first item (``ds_sampler["rng"]``). The verdict judges reseeding from
the indices each epoch received and uses these to say what was and was not called.
"""

from __future__ import annotations

import inspect
import re
import sys

from ...events import Recorded, declare


class EpochCallEvent(Recorded):
    """A method of an order owner's class (``cls``) that takes the epoch was called (``method``,
    with ``epoch``) by ``caller`` (file, line, func)."""

    cls: str
    method: str
    caller: dict


DS_EPOCH_CALL = declare("ds_epoch_call", EpochCallEvent)

# Roles, as the verdict names them.
BATCH_SAMPLER, SAMPLER, WRAPPED = "batch sampler", "sampler", "wrapped sampler"

# torch's samplers whose order is random by construction.
RANDOM_SAMPLERS = ("RandomSampler", "SubsetRandomSampler", "WeightedRandomSampler")
# Lightning's own samplers: reseeded through set_epoch by Lightning.
LIGHTNING_SAMPLERS = ("DistributedSampler", "DistributedSamplerWrapper", "UnrepeatedDistributedSamplerWrapper")

# Words in a user sampler's source that say its order is drawn at random.
_RANDOM_WORDS = re.compile(r"shuffle|randperm|permut|random|default_rng|Generator\(|manual_seed|\brng\b|"
                           r"\.sample\(|\.choice\(|multinomial")


def owners(loader) -> list[dict]:
    """The objects that decide ``loader``'s order, outermost first: a batch sampler other than
    torch's plain ``BatchSampler``, then the sampler (the one a Lightning wrapper holds, when
    wrapped). Each ``{"cls", "role", "user", "epoch_methods", "random_words", "shuffle", "site"}``."""
    from torch.utils.data import BatchSampler

    found = []
    bs = getattr(loader, "batch_sampler", None)
    custom = bs is not None and type(bs) is not BatchSampler
    if custom:
        found.append(_owner(bs, BATCH_SAMPLER))
    # A plain BatchSampler's sampler is the loader's; a custom one's (if any) is what Lightning reseeds.
    sampler = getattr(bs, "sampler", None) if bs is not None else None
    if sampler is None and not custom:
        sampler = getattr(loader, "sampler", None)
    if sampler is not None:
        inner = getattr(getattr(sampler, "dataset", None), "_sampler", None)  # Lightning's wrapper
        if inner is not None and type(sampler).__name__ in LIGHTNING_SAMPLERS:
            found.append(_owner(inner, WRAPPED, wrapper=type(sampler).__name__))
        else:
            found.append(_owner(sampler, SAMPLER))
    return found


def _owner(obj, role: str, wrapper: str | None = None) -> dict:
    cls = type(obj)
    user = is_user_class(cls)
    shuffle = getattr(obj, "shuffle", None)
    return {"cls": cls.__name__, "role": role, "user": user, "wrapper": wrapper,
            "epoch_methods": epoch_methods(cls) if user else [],
            "random_words": random_words(cls) if user else [],
            "shuffle": shuffle if isinstance(shuffle, bool) else None, "site": _site(cls) if user else None}


def is_user_class(cls) -> bool:
    from ...sites import is_user_file

    try:
        path = inspect.getsourcefile(cls)
    except TypeError:
        return False
    return bool(path and is_user_file(path))


def epoch_methods(cls) -> list[str]:
    """Methods of ``cls`` (and its user bases) that take the epoch: ``set_epoch`` whatever its
    parameter is called, and any other with a parameter named ``epoch``, as ``name(params)``."""
    found = []
    for name in sorted({n for klass in cls.__mro__ if is_user_class(klass) for n in vars(klass)}):
        fn = getattr(cls, name, None)
        if name.startswith("__") or not callable(fn):
            continue
        try:
            params = [p for p in inspect.signature(fn).parameters if p != "self"]
        except (TypeError, ValueError):
            continue
        if name == "set_epoch" or "epoch" in params:
            found.append(f"{name}({', '.join(params)})")
    return found


def random_words(cls) -> list[str]:
    """The words of ``cls``'s own source that draw at random (``shuffle``, ``randperm``, ...), once each."""
    try:
        source = inspect.getsource(cls)
    except (TypeError, OSError):
        return []
    return list(dict.fromkeys(m.group(0).strip(".(") for m in _RANDOM_WORDS.finditer(source)))


def _site(cls) -> dict | None:
    try:
        _lines, line = inspect.getsourcelines(cls)
        return {"file": inspect.getsourcefile(cls), "line": line, "func": cls.__qualname__}
    except (TypeError, OSError):
        return None


def rng_state() -> tuple:
    """What the global random generators hold now (torch's CPU one, Python's, NumPy's legacy one
    where NumPy is imported), to tell whether code between two reads drew from them."""
    import random

    import torch

    numpy = sys.modules.get("numpy")
    np_state = None
    if numpy is not None:
        try:
            kind, keys, pos, *_ = numpy.random.get_state()
            np_state = (kind, keys.tobytes(), pos)
        except Exception:
            np_state = None
    return bytes(torch.get_rng_state().numpy().tobytes()), random.getstate(), np_state


def watch_epoch_methods(cls, recorder) -> None:
    """Record each call of ``cls``'s epoch methods (:func:`epoch_methods`) as a ``ds_epoch_call``
    event: the class, the method, the epoch passed and the calling frame (the user's line, or
    Lightning's ``_set_sampler_epoch``)."""
    for text in epoch_methods(cls):
        name = text.split("(", 1)[0]

        def factory(original, name=name):
            def method(obj, *args, **kwargs):
                epoch = args[0] if args else kwargs.get("epoch")
                caller = sys._getframe(1)
                recorder.emit({"ev": DS_EPOCH_CALL, "cls": type(obj).__name__, "method": name,
                               "epoch": epoch if isinstance(epoch, int) else repr(epoch)[:20],
                               "caller": {"file": caller.f_code.co_filename, "line": caller.f_lineno,
                                          "func": caller.f_code.co_name}})
                return original(obj, *args, **kwargs)

            return method

        owner = next((k for k in cls.__mro__ if name in vars(k)), cls)
        recorder.patch(owner, name, factory)
