"""device-placement, rank side: which device each tensor would be on on GPU ranks, followed on CPU ranks.

On CPU ranks every tensor is on the CPU, so a tensor made without a device, a plain attribute that
``.to()`` does not move and a tensor on a hard-coded ``cuda:0`` all look like the module's own.
:class:`DeviceFollower` is the interception's observer (``cuda_on_cpu.Interception.observer``): it
sees every torch call of the traced run and keeps, for the tensors it can place, the device they
would have on GPU ranks (a *tag*: ``"cpu"``, or ``"cuda:K"``; a rank's own device is
``cuda:<local rank>``):

- placed on the rank's own device: the module's parameters and buffers once Lightning moved them,
  everything moved to the strategy's root device or the module's ``self.device`` (a batch), and
  everything made from those;
- placed on the host: a tensor a user frame made without a device (``torch.tensor(x)``,
  ``torch.zeros(n)``, ``torch.from_numpy``), a ``.cpu()`` copy, a plain tensor attribute of a module;
- placed on ``cuda:K``: a tensor made or moved with an explicit CUDA index (or with ``"cuda"``
  while the current device is still GPU 0: before Lightning sets each rank's device).

A tag travels with the results of every call its tensors go into (``torch.zeros_like``, ``+``,
``clone``, ``.to(x.device)``: ``x.device`` is remembered as the device of ``x``); a tensor nobody
placed has no tag and is never judged. Where a user frame's call mixes a host tensor (more than a
0-dim scalar, which CUDA accepts) with one on the rank's device, the same call is run once more
with the device's tensors on the ``meta`` device, which checks devices as CUDA does ("Tensor on
device cpu is not on the expected device meta!"); two different CUDA devices never mix. What
this finds is written as events (``probe.py`` declares them).
"""

from __future__ import annotations

import linecache
import os
import sys
from collections.abc import Callable

from ...cuda_on_cpu import active, cuda_index, user_frame_site

HOST = "cpu"
# The torch call's caller, seen from DeviceFollower.__call__: the interception's _call and the
# mode's __torch_function__ sit in between.
_CALLER = 3

# Calls whose result takes its device from their own arguments rather than from their inputs'.
_COPY_LIKE_NAMES = ("copy_", "to", "type_as", "__getitem__", "__setitem__", "index_put_", "index_put", "expand_as",
                    "view_as", "reshape_as", "new_tensor", "new_zeros", "new_ones", "new_empty", "new_full",
                    "broadcast_tensors", "size", "dim", "numel", "__len__", "__repr__", "__format__", "cpu", "cuda",
                    "detach", "requires_grad_", "data_ptr", "is_set_to", "clone", "contiguous")
# Calls the meta device runs on tensors of two devices although CUDA refuses them (found on torch
# 2.13: meta's kernels for these do not check devices).
_META_LAX_NAMES = ("embedding", "index_select", "gather", "mm", "matmul", "__matmul__", "__rmatmul__", "bmm",
                   "addmm", "linear", "bilinear", "conv1d", "conv2d", "conv3d", "baddbmm", "addmv", "mv", "dot",
                   "scatter", "scatter_add", "scatter_add_", "scatter_", "index_add", "index_add_", "take",
                   "take_along_dim", "einsum", "tensordot", "bucketize", "searchsorted")
_FACTORY_NAMES = ("tensor", "as_tensor", "asarray", "zeros", "ones", "empty", "full", "arange", "range", "linspace",
                  "logspace", "eye", "rand", "randn", "randint", "randperm", "scalar_tensor", "empty_strided",
                  "tril_indices", "triu_indices", "from_numpy")
_NUMPY_NAMES = ("numpy", "__array__")
# Calls that read a tensor's metadata, not its values (a non_blocking copy may be asked its shape).
_METADATA_NAMES = ("size", "dim", "numel", "__len__", "data_ptr", "element_size", "stride", "is_contiguous",
                   "storage_offset", "nelement", "ndimension", "is_pinned", "get_device")


def _funcs(owner_names: tuple, names: tuple) -> set:
    import torch
    import torch.nn.functional as F

    owners = {"torch": torch, "Tensor": torch.Tensor, "F": F}
    found = set()
    for fn in (getattr(owners[o], n, None) for o in owner_names for n in names):
        # Another probe's wrapper (data-sharding wraps torch.randn) calls the original, which is
        # what the mode then sees: keep every function down the __wrapped__ chain.
        while fn is not None and fn not in found:
            found.add(fn)
            fn = getattr(fn, "__wrapped__", None)
    return found


class DeviceFollower:
    """The device each tensor would have on GPU ranks (see the module docstring). ``emit(kind,
    key, event)`` writes a finding once per key; ``current()`` is the CUDA index current on this
    rank (0 until a set_device, the local rank once Lightning set it); ``mimic``: the Trainer
    config is for GPUs, so ``.cpu()`` of a tensor returns a copy, as it does on a GPU."""

    def __init__(self, local_rank: int, emit: Callable, current: Callable[[], int], mimic: bool):
        import torch
        from torch.utils.weak import WeakIdKeyDictionary

        self.own = f"cuda:{local_rank}"
        self.emit = emit
        self.current = current
        self.mimic = mimic
        self.tags = WeakIdKeyDictionary()   # tensor -> (tag, origin dict or None)
        self.devices: dict[int, tuple] = {}  # id(torch.device) -> (tag, origin, the device: kept alive)
        # Host tensors a non_blocking copy from the device fills: on a GPU they are complete only after
        # a synchronisation (torch.cuda.synchronize), so a read before it reads what the buffer held.
        self.pending = WeakIdKeyDictionary()
        self.on = True
        self._tensor = torch.Tensor
        self._device_desc = torch._C.TensorBase.__dict__["device"]
        self._factories = _funcs(("torch",), _FACTORY_NAMES)
        self._copy_like = _funcs(("torch", "Tensor"), _COPY_LIKE_NAMES)
        self._lax = _funcs(("torch", "Tensor", "F"), _META_LAX_NAMES)
        self._numpy = _funcs(("Tensor",), _NUMPY_NAMES)
        self._metadata = _funcs(("Tensor",), _METADATA_NAMES)
        self._to, self._cpu, self._type_as = torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.type_as
        self._default_device = torch.get_default_device
        self._parse_to = torch._C._nn._parse_to
        self._copy = torch.Tensor.copy_

    # -- what is known of a tensor -----------------------------------------------------------------
    def tag(self, t) -> tuple | None:
        """``(tag, origin)`` of a tensor, or None when nobody placed it."""
        try:
            return self.tags.get(t)
        except TypeError:
            return None

    def place(self, t, tag: str | None, origin: dict | None = None) -> None:
        if isinstance(t, self._tensor):
            if tag is None:
                self.tags.pop(t, None)
            else:
                self.tags[t] = (tag, origin)

    def mark_device(self, device, tag: str, origin: dict | None = None) -> None:
        """Remember a ``torch.device`` object as standing for ``tag`` (the root device, ``x.device``)."""
        if len(self.devices) > 4096:
            self.devices.clear()
        self.devices[id(device)] = (tag, origin, device)

    def device_tag(self, device) -> tuple | None:
        """``(tag, origin)`` a device argument stands for: a CUDA name (the index it asks, or the
        current one), a remembered device object, or None (a CPU device nobody placed)."""
        named, index = cuda_index(device) if not isinstance(device, int) else (True, device)
        if named:
            return f"cuda:{self.current() if index is None else index}", None
        known = self.devices.get(id(device))
        return (known[0], known[1]) if known is not None and known[2] is device else None

    # -- the observer ----------------------------------------------------------------------------
    def __call__(self, func, args, kwargs, asked):
        if not self.on:
            return func(*args, **kwargs)
        if type(func).__name__ == "method-wrapper" and getattr(func, "__self__", None) is self._device_desc:
            return self._device_of(func, args, kwargs)
        if func in self._factories:
            return self._factory(func, args, kwargs, asked, sys._getframe(_CALLER))
        if func is self._to or func is self._cpu or func is self._type_as:
            return self._move(func, args, kwargs, asked, sys._getframe(_CALLER))
        if func is self._parse_to:  # Module.to(device): the device its tensors are sent to
            return self._parsed(func, args, kwargs, asked)
        if not self.tags:
            return func(*args, **kwargs)
        ins = self._inputs(args, kwargs)
        out = func(*args, **kwargs)
        if ins:
            frame = sys._getframe(_CALLER)
            if self.pending and func not in self._metadata and type(func).__name__ != "method-wrapper":
                self._read_pending(func, ins, frame)  # a getter (.shape, .dtype) reads no values
            if func is self._copy and (kwargs.get("non_blocking") or (len(args) > 2 and args[2])):
                self._copied(args, frame)
            elif func in self._numpy:
                self._on_numpy(func, ins, frame)
            else:
                self._propagate(func, args, kwargs, ins, out, frame)
        return out

    def _inputs(self, args, kwargs) -> list:
        """``[(tensor, (tag, origin) or None)]`` of the tensor arguments (one level into lists);
        empty when none of them is placed."""
        found, placed = [], False
        for value in (*args, *kwargs.values()):
            items = value if type(value) in (list, tuple) else (value,)
            for item in items:
                if isinstance(item, self._tensor):
                    known = self.tag(item)
                    placed = placed or known is not None
                    found.append((item, known))
        return found if placed else []

    def _device_of(self, func, args, kwargs):
        device = func(*args, **kwargs)
        known = self.tag(args[0]) if args else None
        if known is not None:
            self.mark_device(device, known[0], known[1])
        return device

    def _parsed(self, func, args, kwargs, asked):
        out = func(*args, **kwargs)
        target = asked["device"] if asked else next(
            (a for a in (*args, kwargs.get("device")) if a is not None and _device_like(a)), None)
        placed = self.device_tag(target) if target is not None else None
        if placed is not None and out and out[0] is not None:
            self.mark_device(out[0], placed[0], placed[1])
        return out

    def _factory(self, func, args, kwargs, asked, frame):
        out = func(*args, **kwargs)
        device = kwargs.get("device")
        if device is not None or asked is not None:
            named = asked["device"] if asked else device
            placed = self.device_tag(named)
            if placed is not None:
                self._tag_all(out, placed[0], placed[1] or _origin_of(func, frame, f"device={str(named)!r}"))
            return out
        source = args[0] if args else None
        if isinstance(source, self._tensor):  # torch.tensor(t) / as_tensor(t): t's device
            known = self.tag(source)
            if known is not None:
                self._tag_all(out, *known)
            return out
        site = user_frame_site(frame)
        state = active()
        if state is not None and state.default_cuda:  # torch.set_default_device("cuda"): the current GPU
            self._tag_all(out, f"cuda:{self.current()}", _origin(f"{_name(func)} on the default device, CUDA", site))
        elif site is not None and str(self._default_device()) == "cpu":
            self._tag_all(out, HOST, _origin(f"{_name(func)} without a device", site))
        return out

    def _move(self, func, args, kwargs, asked, frame):
        """``.to(...)``, ``.cpu()``, ``.type_as(other)``: the result is where the call sends it."""
        source = args[0] if args else None
        before = self.tag(source)
        dest = self._destination(func, args, kwargs, asked, frame)
        out = func(*args, **kwargs)
        if dest is False:  # no device in the call (a dtype): the result is where the tensor was
            if out is not source and before is not None:
                self._tag_all(out, *before)
            return out
        if out is source and dest is not None and before is not None and before[0] != HOST and dest[0] == HOST:
            if not (self.mimic and user_frame_site(frame) is not None):
                return out  # the same tensor stays on the device too: placing it on the host would move it
            out = out.clone()  # on a GPU, .cpu() of a tensor on the device is a new tensor
        self._tag_all(out, dest[0] if dest else None, dest[1] if dest else None)
        if kwargs.get("non_blocking") and dest is not None and dest[0] == HOST and before is not None and \
                before[0] != HOST and out is not source:
            self.pending[out] = user_frame_site(frame)
        return out

    def synchronized(self) -> None:
        """torch.cuda.synchronize(): every non_blocking copy is complete."""
        self.pending.clear()

    def _copied(self, args, frame) -> None:
        """``host.copy_(device_tensor, non_blocking=True)``: the host tensor is pending."""
        dst, src = args[0], args[1]
        to, of = self.tag(dst), self.tag(src) if isinstance(src, self._tensor) else None
        if to is not None and to[0] == HOST and of is not None and of[0] != HOST:
            self.pending[dst] = user_frame_site(frame)

    def _read_pending(self, func, ins, frame) -> None:
        for tensor, _ in ins:
            copied = self.pending.pop(tensor, None) if tensor in self.pending else False
            if copied is False:
                continue
            site = user_frame_site(frame)
            if site is not None and copied is not None:
                self.emit("unsynced", (site["file"], site["line"]),
                          {"api": _name(func), "site": site, "copy": copied})

    def _destination(self, func, args, kwargs, asked, frame):
        """Where a move sends its tensor: ``(tag, origin)``; None when nobody placed the target;
        False when the call names no device."""
        if func is self._cpu:
            site = user_frame_site(frame)
            return (HOST, _origin(".cpu()", site)) if site is not None else None
        if asked is not None:
            return self.device_tag(asked["device"])
        target = args[1] if len(args) > 1 else kwargs.get("device", kwargs.get("other"))
        if isinstance(target, self._tensor):
            return self.tag(target)
        if func is self._type_as or target is None or not _device_like(target):
            return False if func is not self._type_as else None
        placed = self.device_tag(target)
        if placed is None and str(target) == "cpu" and _literal_cpu(frame):
            return HOST, _origin(".to('cpu')", user_frame_site(frame))
        return placed

    def _tag_all(self, out, tag: str | None, origin: dict | None) -> None:
        if isinstance(out, (list, tuple)):
            for item in out:
                self.place(item, tag, origin)
        else:
            self.place(out, tag, origin)

    # -- what a call of tensors of several devices means ----------------------------------------------
    def _propagate(self, func, args, kwargs, ins, out, frame) -> None:
        if "device" in kwargs and kwargs["device"] is not None:
            placed = self.device_tag(kwargs["device"])
            self._tag_all(out, placed[0] if placed else None, placed[1] if placed else None)
            return
        cuda = sorted({k[0] for _, k in ins if k is not None and k[0] != HOST})
        host = [(t, k) for t, k in ins if k is not None and k[0] == HOST]
        if func not in self._copy_like and cuda:
            self._check_mix(func, args, kwargs, ins, cuda, host, frame)
        first = args[0] if args else None
        if out is first:
            return  # in place: the tensor stays where it is
        if func in self._copy_like:  # detach, view_as, new_zeros...: on the device of the tensor it is called on
            known = self.tag(first) if isinstance(first, self._tensor) else None
            self._tag_all(out, known[0] if known else None, known[1] if known else None)
            return
        if cuda:
            tag = self.own if self.own in cuda else cuda[0]
            origin = next((k[1] for _, k in ins if k is not None and k[0] == tag), None)
        elif host and len(host) == len(ins):
            tag, origin = HOST, host[0][1][1]
        else:
            return
        self._tag_all(out, tag, origin)

    def _check_mix(self, func, args, kwargs, ins, cuda, host, frame) -> None:
        """Tensors of two devices in one call of a user frame: two CUDA devices always fail; a
        host tensor beside a CUDA one fails where CUDA refuses it (the meta device's check, or a
        call meta does not check; an in-place result on the host always)."""
        if len(cuda) > 1:
            site = user_frame_site(frame)
            if site is not None:
                self._mixed(func, site, ins, cuda, "two CUDA devices")
            return
        if not host:
            return
        big = [(t, k) for t, k in host if t.dim() > 0]
        in_place = bool(args) and any(args[0] is t for t, _ in host) and _in_place(func)
        site = user_frame_site(frame) if big or in_place else None
        if site is None:
            return
        why = "an in-place result on the host" if in_place else (
            "CUDA does not mix devices in it" if func in self._lax else _meta_refuses(func, args, kwargs, big))
        if why:
            self._mixed(func, site, ins, [*cuda, HOST], why)

    def _mixed(self, func, site, ins, devices, why: str) -> None:
        origins = [k[1] for _, k in ins if k is not None and k[1] is not None]
        devices = sorted(dict.fromkeys(devices), key=lambda d: (d != self.own, d))  # the rank's own first
        self.emit("mix", (site["file"], site["line"]),
                  {"api": _name(func), "site": site, "devices": devices, "why": why, "origins": origins[:3]})

    def _on_numpy(self, func, ins, frame) -> None:
        tensor, known = ins[0]
        site = user_frame_site(frame)
        if site is not None and known is not None and known[0] != HOST:
            self.emit("numpy", (site["file"], site["line"]),
                      {"api": _name(func), "site": site, "device": known[0], "origin": known[1]})


def _meta_refuses(func, args, kwargs, host) -> str | None:
    """The device error the call raises with its host tensors kept on the CPU and every other
    tensor on the meta device (which checks devices as CUDA does); None when it runs there, or
    cannot say (a kernel meta lacks, a value meta cannot know)."""
    import torch
    from torch.utils._pytree import tree_map

    keep = {id(t) for t, _ in host}

    def stand_in(x):
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) in keep:
            return x.detach().clone()
        return torch.empty_like(x, device="meta")

    try:
        func(*tree_map(stand_in, args), **tree_map(stand_in, kwargs))
    except Exception as exc:  # the call's own verdict on the devices
        text = str(exc)
        return text.splitlines()[0][:200] if "device" in text else None
    return None


def _in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.startswith("_") or name.startswith("__i")


def _device_like(value) -> bool:
    kind = type(value).__name__
    return kind in ("str", "device") or (kind == "int" and not isinstance(value, bool))


def _literal_cpu(frame) -> bool:
    """Whether the source line of ``frame`` spells the CPU as a literal (``.to("cpu")``), rather than
    through a name that could hold "cuda" on a GPU machine."""
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno) if frame is not None else ""
    return ('"cpu"' in line or "'cpu'" in line) and "is_available" not in line


def _name(func) -> str:
    owner = getattr(func, "__objclass__", None)
    name = getattr(func, "__name__", repr(func))
    if owner is not None and owner.__name__ in ("TensorBase", "Tensor"):
        return f"Tensor.{name}"
    module = getattr(func, "__module__", "") or ""
    return f"F.{name}" if module.endswith("nn.functional") else f"torch.{name}"


def _origin(how: str, site: dict | None, **extra) -> dict | None:
    return {"how": how, "site": site, **extra} if site is not None else None


def _origin_of(func, frame, how: str) -> dict | None:
    return _origin(f"{_name(func)}({how})", user_frame_site(frame))


def plain_tensor_attributes(model, limit: int = 200) -> list[tuple[str, object]]:
    """``[(attribute path, tensor)]`` of the plain tensor attributes of ``model`` and its
    submodules (set with ``self.x = tensor``, not parameters, buffers or TorchMetrics states,
    which ``.to()`` moves), tensors in a list, tuple or dict attribute included."""
    import torch

    moved = {id(t) for t in (*model.parameters(), *model.buffers())}
    found: list[tuple[str, object]] = []
    for prefix, module in model.named_modules():
        # A TorchMetrics Metric moves the states it declared (add_state) and keeps its own bookkeeping
        # (_defaults, _computed, ...); a tensor it holds as a plain attribute stays where it was made.
        states = set(getattr(module, "_defaults", {}) or ()) if _is_metric(module) else set()
        for name, value in vars(module).items():
            if name in states or (states and name.startswith("_")) or \
                    name in ("_device", "_example_input_array", "example_input_array"):
                continue
            items = value.items() if isinstance(value, dict) else enumerate(value) \
                if isinstance(value, (list, tuple)) else [(None, value)]
            for key, item in items:
                if isinstance(item, torch.Tensor) and not isinstance(item, torch.nn.Parameter) and \
                        id(item) not in moved and item.device.type != "meta":
                    path = ".".join(p for p in (prefix, name) if p) + (f"[{key!r}]" if key is not None else "")
                    found.append((path, item))
                if len(found) >= limit:
                    return found
    return found


def _is_metric(module) -> bool:
    return any(k.__name__ == "Metric" and k.__module__.startswith("torchmetrics") for k in type(module).__mro__)


def source_line(site: dict | None) -> str:
    """The stripped source line of a site ('' when unreadable)."""
    if not site or not site.get("file") or not os.path.exists(site["file"]):
        return ""
    return linecache.getline(site["file"], site.get("line") or 0).strip()
