"""What user code seeded, with which value, and where it read its local rank from the environment.

Installed through a rank's :class:`~.trace.Recorder` (undone with it):

- :func:`watch_seeding` wraps the functions that seed a global generator (``random.seed``,
  ``numpy.random.seed``, ``torch.manual_seed``; Lightning's ``seed_everything`` calls them) and
  ``torch.Generator`` (its ``manual_seed``): one ``user_seed`` event per call made from user code,
  directly or through a library, with its ``value``, site and hook.
- :func:`watch_env_rank` wraps ``os.environ``'s lookup: a read of ``LOCAL_RANK`` made by user code
  itself (``os.environ[...]``, ``os.environ.get``, ``os.getenv``) is one ``env_rank_read`` event
  per user line, with the line's source text. A library's read (Lightning's cluster environment)
  is not user code's and is not recorded.

A seed derived from the local rank repeats on every node; data-sharding names it from these
events. Imports nothing of torch at module level.
"""

from __future__ import annotations

import linecache
import os
import sys

from .events import ENV_RANK_READ, USER_SEED
from .sites import is_user_file, user_site

# The functions that seed the global generators (Lightning's seed_everything calls them): a module
# that calls one seeds itself, and the plugin's seeding of its ranks then leaves it alone.
SEEDERS = (("random", "seed"), ("numpy.random", "seed"), ("torch", "manual_seed"))
ENV_KEYS = ("LOCAL_RANK",)
# Frames between user code and os.environ's lookup: os.getenv and Mapping.get (frozen modules or files).
_LOOKUP_FILES = (os.sep + "os.py", os.sep + "_collections_abc.py", "<frozen os>", "<frozen _collections_abc>")


def _value(args: tuple, kwargs: dict):
    """The seed passed: an int as such, anything else as its repr (None when none was passed)."""
    value = args[0] if args else kwargs.get("seed", kwargs.get("a"))
    if value is None or isinstance(value, int):
        return value
    try:
        return int(value) if hasattr(value, "__index__") else repr(value)[:60]
    except Exception:
        return repr(value)[:60]


def watch_seeding(recorder) -> list[dict]:
    """Record every call user code makes (directly or through a library, such as seed_everything)
    to a function that seeds a global generator, or to a ``torch.Generator``'s ``manual_seed``:
    one ``user_seed`` event with its value, site and hook, also kept in the list returned (the
    global generators' only: a Generator of its own is not the module seeding itself)."""
    seen: list[dict] = []

    def note(label, args, kwargs, keep: bool) -> None:
        site, direct = user_site(3)
        # A Generator is seeded by libraries too (a DistributedSampler every epoch): only user code's own call.
        if site is not None and (keep or direct):
            event = USER_SEED.new(fn=label, site=site, hook=recorder.current_hook(), value=_value(args, kwargs))
            if keep:
                seen.append(dict(event))
            recorder.emit(event)

    def factory(original, label):
        def seed(*args, **kwargs):
            note(label, args, kwargs, True)
            return original(*args, **kwargs)

        return seed

    for module, name in SEEDERS:
        owner = sys.modules.get(module)
        if owner is not None and hasattr(owner, name):
            recorder.patch(owner, name, lambda original, label=f"{module}.{name}": factory(original, label))
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(getattr(torch, "Generator", None), type):
        recorder.patch(torch, "Generator", lambda original: _generator_class(original, note))
    return seen


def _generator_class(original: type, note) -> type:
    """A subclass of ``torch.Generator`` whose ``manual_seed`` is recorded; ``isinstance`` and
    ``issubclass`` against it answer for every torch Generator (the default ones included)."""
    meta = type(original)

    class _Meta(meta):
        def __instancecheck__(cls, obj):
            return isinstance(obj, original)

        def __subclasscheck__(cls, sub):
            return issubclass(sub, original)

    def manual_seed(self, *args, **kwargs):
        try:
            note("torch.Generator.manual_seed", args, kwargs, False)
        except Exception:
            pass  # a seed that cannot be recorded is not recorded; the user's call goes on
        return original.manual_seed(self, *args, **kwargs)

    return _Meta("Generator", (original,), {"manual_seed": manual_seed, "__module__": "torch",
                                            "__qualname__": "Generator"})


def _direct_user_frame(depth: int):
    """The frame that looked the variable up when it is user code (past os.getenv and Mapping.get),
    else None: a library reading the environment is not user code reading it."""
    frame = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.endswith(_LOOKUP_FILES):
        frame = frame.f_back
    return frame if frame is not None and is_user_file(frame.f_code.co_filename) else None


def watch_env_rank(recorder) -> None:
    """Record user code's own reads of ``LOCAL_RANK`` from ``os.environ`` (one event per line)."""
    seen: set = set()

    def factory(original):
        def getitem(self, key):
            value = original(self, key)
            if key in ENV_KEYS and self is os.environ and len(seen) < 16:
                try:
                    _record(key, value)
                except Exception:
                    pass  # a read that cannot be recorded is not recorded; the user's code goes on
            return value

        return getitem

    def _record(key, value) -> None:
        frame = _direct_user_frame(3)
        if frame is None or (frame.f_code.co_filename, frame.f_lineno) in seen:
            return
        seen.add((frame.f_code.co_filename, frame.f_lineno))
        site, _ = user_site(3)
        code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        recorder.emit(ENV_RANK_READ.new(key=key, value=value, site=site, code=code, hook=recorder.current_hook()))

    recorder.patch(type(os.environ), "__getitem__", factory)
