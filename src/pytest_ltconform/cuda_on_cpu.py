"""Code that names CUDA, run on CPU ranks: the interception every run of a CPU world makes (rank side).

Code written for GPU ranks names CUDA: ``torch.arange(n, device="cuda:0")``, ``.cuda(i)``,
``.to(f"cuda:{rank}")``, ``torch.cuda.set_device(rank)``, ``torch.load(path,
map_location="cuda:0")``. On a torch built without CUDA each of them raises ("Torch not compiled
with CUDA enabled"), so nothing of such a module could be judged. While a job runs on a CPU rank,
:func:`intercept` runs those calls on the rank's own device (the CPU) instead, so the fit goes on
and every contract still judges the module, and records each one a user frame made, with the index
it asked for, as a :data:`EV_CUDA` event:

- a :class:`CudaOnCpu` torch function mode sees every torch call before its arguments are parsed:
  a CUDA ``device=`` (string, ``torch.device`` or index), the device of ``Tensor.to`` and
  ``Tensor.cuda``, and ``pin_memory`` become the rank's device;
- ``torch.cuda.set_device``, ``current_device`` (the index last set, 0 before), ``synchronize``,
  ``torch.cuda.device(i)``, the memory-statistics resets and ``device_count`` (asked from user
  code while the Trainer config is for GPUs: the ranks per node) are patched beside it;
- ``torch.load`` with a CUDA ``map_location`` loads onto the CPU; one without ``map_location``
  that holds CUDA storages (saved on a GPU) is loaded again onto the CPU (:data:`EV_LOAD`);
- what cannot be given on a CPU (a stream, an event, a device's name or memory) raises
  :class:`CudaNotMappable` at the user's line after an :data:`EV_UNMAPPED` event, so the run's
  stop says why and where instead of "Torch not compiled with CUDA enabled".

Nothing changes for code that names no CUDA device: only arguments that would raise on this torch
are replaced. An observer (``Interception.observer``, set by a probe) sees every call the mode
sees, to follow devices further. In a GPU world (real devices) nothing is replaced or patched;
the requests are still recorded. DataLoader workers forked from a rank keep the mode: what they ask
for is written to a side file the rank reads at the end (:meth:`Interception.worker_events`).

Imports torch only when entered. The events are declared here, next to what emits them.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from .events import Recorded, declare
from .sites import is_user_file

# -- events --------------------------------------------------------------------------------------


class CudaRequest(Recorded, total=False):
    """:data:`EV_CUDA`: ``api`` (``torch.arange``, ``Tensor.cuda``, ``torch.cuda.set_device``...),
    ``device`` as asked (``"cuda:0"``, ``"cuda"``), ``index`` (None: the current device),
    ``current`` (the index current on this rank then, 0 when none was set), ``site`` (the user's
    frame), ``direct`` (the user frame made the call itself), ``hook``, ``rank``, ``local_rank``,
    ``mapped`` (the device it ran on; None in a GPU world), ``worker`` (made in a DataLoader
    worker process: its pid). One event per (site, api, device) and process."""

    api: str
    device: str | None
    index: int | None
    current: int
    site: dict | None
    direct: bool
    hook: str | None
    rank: int
    local_rank: int
    mapped: str | None
    worker: int


class TorchLoad(Recorded, total=False):
    """:data:`EV_LOAD`: ``site``, ``hook``, ``map_location`` (repr; None when not given),
    ``cuda`` (the load found storages saved on a CUDA device and loaded them onto the CPU),
    ``path``."""

    site: dict | None
    hook: str | None
    map_location: str | None
    cuda: bool
    path: str | None


class CudaUnmapped(Recorded, total=False):
    """:data:`EV_UNMAPPED`: ``api`` the CUDA call, ``site`` the user's frame, ``why``."""

    api: str
    site: dict | None
    why: str


EV_CUDA = declare("cuda_request", CudaRequest)      # a user frame asked for a CUDA device or called torch.cuda
EV_LOAD = declare("torch_load", TorchLoad)          # a user frame called torch.load
EV_UNMAPPED = declare("cuda_unmapped", CudaUnmapped)  # a CUDA call this interception cannot run on a CPU


class CudaNotMappable(AssertionError):
    """A CUDA call the plugin cannot run on a CPU-only torch (an AssertionError, as torch's own
    "Torch not compiled with CUDA enabled" is, so code that catches that catches this)."""


# -- where a call comes from ------------------------------------------------------------------------

_LIGHTNING = tuple(os.sep + name + os.sep for name in ("lightning", "pytorch_lightning", "lightning_fabric"))


def user_frame_site(frame) -> dict | None:
    """The site (``{"file", "line", "func"}``) of the first user frame at or above ``frame``, above
    torch's own frames (``model.cuda()`` reaches ``Tensor.cuda`` through ``nn.Module._apply``); None
    when Lightning's code comes first (Lightning made the call) or no user frame is near."""
    for _ in range(12):
        if frame is None:
            return None
        name = frame.f_code.co_filename
        if is_user_file(name):
            return {"file": name, "line": frame.f_lineno, "func": getattr(frame.f_code, "co_qualname",
                                                                          frame.f_code.co_name)}
        if any(part in name for part in _LIGHTNING) and not name.endswith(_THIN):
            return None
        frame = frame.f_back
    return None


# Lightning's own frames that only pass a user's call on (LightningModule.cuda/.to/.type).
_THIN = os.sep + "device_dtype_mixin.py"


def caller_site(depth: int = 2) -> tuple[dict | None, bool]:
    """``(site, direct)`` of the user frame behind a call (:func:`user_frame_site` of the frame
    ``depth`` up), and whether that frame made the call itself."""
    frame = sys._getframe(depth)
    site = user_frame_site(frame)
    return site, site is not None and site["file"] == frame.f_code.co_filename and site["line"] == frame.f_lineno


def cuda_index(value: Any) -> tuple[bool, int | None]:
    """``(names CUDA, index)`` for a device value: ``"cuda"`` -> (True, None), ``"cuda:1"`` and
    ``torch.device("cuda", 1)`` -> (True, 1); anything else (False, None)."""
    kind = type(value).__name__
    if kind == "str":
        if not value.startswith("cuda"):
            return False, None
        _, _, index = value.partition(":")
        return (True, int(index)) if index.isdigit() else (value == "cuda", None)
    if kind == "device" and value.type == "cuda":
        return True, value.index
    return False, None


# -- the mode -----------------------------------------------------------------------------------------

class Interception:
    """One job's interception on one rank: what it maps, what it has recorded, and who is told.

    ``emit(event)`` writes an event (None in an untraced run); ``mapping``: replace CUDA devices by
    ``target`` (a CPU world); ``gpu_config``: the user's Trainer config is for GPUs (``device_count``
    then answers the ranks per node to user code); ``observer(func, args, kwargs, asked)`` (set by a
    probe) runs each call the mode sees instead of the mode running it; ``unmapped`` callbacks hear
    of a call that cannot be mapped before it raises."""

    def __init__(self, rank: int, local_rank: int, ranks_per_node: int, emit: Callable | None, mapping: bool,
                 side_path: str | None = None):
        self.rank = rank
        self.local_rank = local_rank
        self.ranks_per_node = ranks_per_node
        self.emit = emit
        self.mapping = mapping
        self.gpu_config = False
        self.current: int | None = None   # the index torch.cuda.set_device last set here
        self.observer: Callable | None = None
        self.unmapped: list[Callable] = []
        self.synchronized: list[Callable] = []  # told of each torch.cuda.synchronize()
        self.default_cuda = False  # user code made CUDA torch's default device (set_default_device)
        self.pid = os.getpid()
        self.side_path = side_path
        self._seen: set[tuple] = set()
        self.target = None  # torch.device("cpu"), set when entered

    def current_index(self) -> int:
        return 0 if self.current is None else self.current

    def record(self, api: str, device: str | None, index: int | None, site: dict | None, direct: bool,
               hook: str | None = None) -> None:
        """One :data:`EV_CUDA` event per (site, api, device) and process."""
        if site is None:
            return
        key = (site["file"], site["line"], api, device)
        if key in self._seen:
            return
        event: CudaRequest = {"ev": EV_CUDA, "api": api, "device": device, "index": index,
                              "current": self.current_index(), "site": site, "direct": direct, "hook": hook,
                              "rank": self.rank, "local_rank": self.local_rank,
                              "mapped": str(self.target) if self.mapping else None}
        self._seen.add(key)
        self._write(dict(event))

    def _write(self, event: dict) -> None:
        if _ACTIVE is not self:
            return  # a name the user's module kept from an earlier job: it maps, it records nothing
        if os.getpid() != self.pid:  # a DataLoader worker: its rank's trace is not its own to write
            event["worker"] = os.getpid()
            if self.side_path:
                with contextlib.suppress(OSError), open(self.side_path, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(event, default=repr) + "\n")
            return
        if self.emit is not None:
            self.emit(event)

    def worker_events(self) -> list[dict]:
        """What this rank's forked DataLoader workers recorded (read once, at the end)."""
        if not self.side_path or not os.path.exists(self.side_path):
            return []
        with open(self.side_path, encoding="utf-8") as fh:
            events = [json.loads(line) for line in fh if line.strip()]
        os.remove(self.side_path)
        return events

    def not_mappable(self, api: str, why: str) -> CudaNotMappable:
        """Record a call that cannot run here and return the exception to raise, naming the line."""
        site, _ = caller_site(3)
        event: CudaUnmapped = {"ev": EV_UNMAPPED, "api": api, "site": site, "why": why}
        self._write(dict(event))
        for tell in self.unmapped:
            with contextlib.suppress(Exception):
                tell(dict(event))
        from .sites import fmt_site

        where = f" at {fmt_site(site)}" if site else ""
        return CudaNotMappable(f"{api}{where} needs a CUDA device: {why}. pytest-ltconform runs code that names CUDA "
                               f"on the rank's CPU, but cannot give this on a torch without CUDA; run the GPU tier "
                               f"(-m ltconform_gpu on a machine with GPUs) to judge it")


def _mode_class():
    from torch.overrides import TorchFunctionMode

    class CudaOnCpu(TorchFunctionMode):
        """Replaces CUDA devices in a torch call by the rank's device and records the request
        (see the module docstring); hands the call to the observer when one is set."""

        def __init__(self, state: Interception):
            super().__init__()
            self.state = state

        def __torch_function__(self, func, types, args=(), kwargs=None):
            return _call(self.state, func, args, kwargs or {})

    return CudaOnCpu


_FUNCS: dict = {}


def _torch_funcs() -> dict:
    if not _FUNCS:
        import torch

        _FUNCS.update(to=torch.Tensor.to, cuda=torch.Tensor.cuda, pin=torch.Tensor.pin_memory, device=torch.device)
    return _FUNCS


def _call(state: Interception, func, args, kwargs):
    funcs = _FUNCS or _torch_funcs()
    asked = None
    if func is funcs["to"] or func is funcs["cuda"] or func is funcs["pin"]:
        func, args, kwargs, asked = _move(state, funcs, func, args, kwargs)
    elif func is not funcs["device"]:  # a torch.device("cuda", 1) is only a name until it is used
        args, kwargs, asked = _devices(state, func, args, kwargs)
    observer = state.observer
    if observer is not None:
        return observer(func, args, kwargs, asked)
    return func(*args, **kwargs)


def _devices(state: Interception, func, args, kwargs):
    """A CUDA ``device=`` or positional device of any torch call; ``pin_memory=True``."""
    asked = None
    device = kwargs.get("device")
    if device is not None:
        named, index = cuda_index(device) if not isinstance(device, int) else (True, device)
        if named:
            asked = _asked(state, func, str(device) if not isinstance(device, int) else f"cuda:{device}", index)
            if state.mapping:
                kwargs = {**kwargs, "device": state.target}
    if kwargs.get("pin_memory") and state.mapping:
        kwargs = {**kwargs, "pin_memory": False}
    for pos, value in enumerate(args):
        kind = type(value).__name__
        if kind == "str" or kind == "device":
            named, index = cuda_index(value)
            if named:
                asked = _asked(state, func, str(value), index)
                if state.mapping:
                    args = (*args[:pos], state.target, *args[pos + 1:])
    return args, kwargs, asked


def _move(state: Interception, funcs: dict, func, args, kwargs):
    """``Tensor.to(cuda)``, ``Tensor.cuda(i)`` and ``Tensor.pin_memory()``."""
    if func is funcs["pin"]:
        return ((lambda t, *a, **k: t), args, kwargs, None) if state.mapping else (func, args, kwargs, None)
    if func is funcs["cuda"]:
        device = args[1] if len(args) > 1 else kwargs.get("device")
        index = device if isinstance(device, int) else cuda_index(device)[1] if device is not None else None
        asked = _asked(state, func, "cuda" if index is None else f"cuda:{index}", index)
        if not state.mapping:
            return func, args, kwargs, asked
        keep = {k: v for k, v in kwargs.items() if k in ("non_blocking", "memory_format")}
        return funcs["to"], (args[0], state.target), keep, asked
    target = args[1] if len(args) > 1 else kwargs.get("device")
    named, index = (True, target) if isinstance(target, int) and not isinstance(target, bool) else cuda_index(target)
    if not named:
        return func, args, kwargs, None
    asked = _asked(state, func, "cuda" if index is None else f"cuda:{index}", index)
    if state.mapping:
        if len(args) > 1:
            args = (args[0], state.target, *args[2:])
        else:
            kwargs = {**kwargs, "device": state.target}
    return func, args, kwargs, asked


def _asked(state: Interception, func, device: str, index: int | None) -> dict:
    """Record a request (the caller of the torch call is 5 frames up: _asked, _devices or _move,
    _call, the mode's __torch_function__)."""
    site, direct = caller_site(5)
    state.record(_api_name(func), device, index, site, direct, _hook())
    return {"device": device, "index": index, "site": site, "direct": direct}


def _api_name(func) -> str:
    owner = getattr(func, "__objclass__", None) or getattr(func, "__self__", None)
    name = getattr(func, "__name__", repr(func))
    if name == "_parse_to":
        return "Module.to"
    if owner is not None and getattr(owner, "__name__", "") in ("TensorBase", "Tensor"):
        return f"Tensor.{name}"
    module = getattr(func, "__module__", None) or "torch"
    if module.startswith("torch._C") or module == "torch":
        return f"torch.{name}"
    return f"{module}.{name}"


_HOOK: Callable[[], str | None] = lambda: None  # noqa: E731 (the recorder's current hook, while one runs)


def _hook() -> str | None:
    try:
        return _HOOK()
    except Exception:
        return None


# -- torch.cuda and torch.load --------------------------------------------------------------------------

def _cuda_patches(state: Interception) -> list[tuple[Any, str, Any]]:
    """(owner, name, replacement) for the torch.cuda calls that raise on a CPU-only torch."""
    import torch

    cuda = torch.cuda

    def current_device() -> int:
        site, direct = caller_site(2)
        state.record("torch.cuda.current_device", None, None, site, direct, _hook())
        return state.current_index()

    def exchange(device) -> int:
        previous = state.current_index()
        index = device if isinstance(device, int) else cuda_index(device)[1]
        if index is not None and index >= 0:
            state.current = index
        return previous

    def nothing(*args, **kwargs) -> None:
        return None

    def synchronize(*args, **kwargs) -> None:
        for tell in state.synchronized:
            with contextlib.suppress(Exception):
                tell()

    original_count = cuda.device_count

    def device_count() -> int:
        site, direct = caller_site(2)
        if site is None or not state.gpu_config:
            return original_count()
        state.record("torch.cuda.device_count", None, None, site, direct, _hook())
        return state.ranks_per_node

    original_init = cuda._lazy_init

    def lazy_init() -> None:
        try:
            return original_init()
        except AssertionError as exc:
            raise state.not_mappable(_cuda_caller(), f"torch says {exc}") from None

    patches = [(torch, "set_default_device", _default_device(state, torch.set_default_device)),
               (cuda, "set_device", _recording_set_device(state, None)), (cuda, "current_device", current_device),
               (cuda, "_exchange_device", exchange), (cuda, "_maybe_exchange_device", exchange),
               (cuda, "device_count", device_count), (cuda, "_lazy_init", lazy_init),
               (cuda, "synchronize", synchronize)]
    patches += [(cuda, name, nothing) for name in ("reset_peak_memory_stats", "ipc_collect",
                                                   "reset_max_memory_allocated", "reset_accumulated_memory_stats",
                                                   "set_per_process_memory_fraction")]
    patches += [(cuda, name, _refusing(state, f"torch.cuda.{name}", why)) for name, why in _NOT_MAPPABLE.items()]
    return patches


def _recording_set_device(state: Interception, original):
    """torch.cuda.set_device recorded and made the current index; ``original`` (a GPU world's) then
    runs too, None on a CPU, where it would raise."""

    def set_device(device) -> None:
        index = device if isinstance(device, int) else cuda_index(device)[1] if device is not None else None
        site, direct = caller_site(2)
        state.record("torch.cuda.set_device", None if index is None else f"cuda:{index}", index, site, direct, _hook())
        if index is not None and index >= 0:
            state.current = index
        if original is not None:
            original(device)

    return set_device


def _default_device(state: Interception, original):
    """torch.set_default_device naming CUDA: recorded, and the CPU made the default instead."""

    def set_default_device(device) -> None:
        named, index = cuda_index(device) if not isinstance(device, int) else (True, device)
        if named:
            site, direct = caller_site(2)
            state.record("torch.set_default_device", str(device), index, site, direct, _hook())
        state.default_cuda = named
        return original("cpu" if named else device)

    return set_default_device


_NOT_MAPPABLE = {
    "get_device_name": "a CPU has no CUDA device name", "get_device_properties": "a CPU has no CUDA device properties",
    "get_device_capability": "a CPU has no compute capability", "mem_get_info": "a CPU has no CUDA memory to report",
    "Stream": "CUDA streams exist only on a CUDA device", "current_stream": "CUDA streams exist only on a CUDA device",
    "Event": "CUDA events exist only on a CUDA device",
}


def _refusing(state: Interception, api: str, why: str):
    def refuse(*args, **kwargs):
        raise state.not_mappable(api, why)

    return refuse


def _cuda_caller() -> str:
    """The torch.cuda function a lazy CUDA initialisation came from (``torch.cuda.<name>``), for
    the message; ``a CUDA call`` when none is on the stack."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if os.sep + os.path.join("torch", "cuda") + os.sep in name and frame.f_code.co_name != "_lazy_init":
            return f"torch.cuda.{frame.f_code.co_name}"
        if is_user_file(name):
            break
        frame = frame.f_back
    return "a CUDA call"


_CUDA_STORAGE = "Attempting to deserialize object on a CUDA device"


def _load_patch(state: Interception, original):
    """torch.load that maps CUDA: a ``map_location`` naming CUDA loads onto the rank's device; a
    load without one that meets CUDA storages (a file saved on a GPU) is read again onto the CPU.
    A user frame's call is recorded (:data:`EV_LOAD`); others only mapped."""

    def load(f, map_location=None, *args, **kwargs):
        site, direct = caller_site(2)
        given, mapped = map_location, _mapped_location(map_location) if state.mapping else map_location
        named, index = cuda_index(given) if not isinstance(given, dict) else (False, None)
        if named:
            state.record("torch.load(map_location)", str(given), index, site, direct, _hook())
        event: TorchLoad = {"ev": EV_LOAD, "site": site, "hook": _hook(),
                            "map_location": None if given is None else repr(given), "cuda": False,
                            "path": os.fspath(f) if isinstance(f, (str, os.PathLike)) else None}
        try:
            return original(f, mapped, *args, **kwargs)
        except RuntimeError as exc:
            if not (state.mapping and _CUDA_STORAGE in str(exc) and _rewind(f)):
                raise
            event["cuda"] = True
            return original(f, "cpu", *args, **kwargs)
        finally:
            if site is not None:
                state._write(dict(event))

    return load


def _mapped_location(location):
    """A ``map_location`` with every CUDA target replaced by the CPU (callables left as they are)."""
    if isinstance(location, dict):
        return {k: ("cpu" if cuda_index(v)[0] else v) for k, v in location.items()}
    return "cpu" if cuda_index(location)[0] else location


def _rewind(f) -> bool:
    if isinstance(f, (str, bytes, os.PathLike)):
        return True
    try:
        f.seek(0)
        return True
    except (AttributeError, OSError, ValueError):
        return False


# -- entering it -------------------------------------------------------------------------------------

_ACTIVE: Interception | None = None


def active() -> Interception | None:
    """The interception of the job running on this rank now (None outside one)."""
    return _ACTIVE


@contextlib.contextmanager
def intercept(rank: int, local_rank: int, ranks_per_node: int, emit: Callable | None, mapping: bool,
              side_path: str | None = None, hook: Callable[[], str | None] | None = None) -> Iterator[Interception]:
    """The interception for one job (see the module docstring): the mode entered and, with
    ``mapping`` (a CPU world), torch.cuda and torch.load patched, all undone on exit. ``hook``
    names the hook running now (the recorder's), for the events."""
    global _ACTIVE, _HOOK
    import torch

    state = Interception(rank, local_rank, ranks_per_node, emit, mapping, side_path)
    state.target = torch.device("cpu")
    patches = (_cuda_patches(state) + [(torch, "load", _load_patch(state, torch.load))]) if mapping else \
        [(torch.cuda, "set_device", _recording_set_device(state, torch.cuda.set_device))]
    undo = []
    for owner, name, replacement in patches:
        undo.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, replacement)
    previous, previous_hook = _ACTIVE, _HOOK
    _ACTIVE, _HOOK = state, (hook or (lambda: None))
    mode = _mode_class()(state)
    try:
        with mode:
            yield state
    finally:
        _ACTIVE, _HOOK = previous, previous_hook
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)


@contextlib.contextmanager
def where_no_cuda() -> Iterator[Interception | None]:
    """Outside a rank's job (a target's validation, spawn-safety's fresh import): where torch has no
    CUDA device, code that names CUDA runs on the CPU as it does in the ranks, recording nothing;
    where it has one, nothing changes."""
    import torch

    if torch.cuda.is_available():
        yield None
        return
    with intercept(0, 0, 1, None, mapping=True) as state:
        yield state
