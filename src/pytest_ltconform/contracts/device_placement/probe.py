"""device-placement, rank side (the traced fit): what the module does with devices, as GPU ranks would see it.

Installed before the user's module is imported, the probe

- follows the device each tensor would have on GPU ranks (:class:`~.follow.DeviceFollower`, the
  interception's observer; in a GPU world tensors are on their real devices and nothing is followed);
- reads every tensor a collective is given (``Recorder.add_call_tap``: ``torch.distributed``'s
  collectives, also those inside ``all_gather_object``, Lightning's ``all_gather``, ``reduce`` and
  the sync of ``self.log(..., sync_dist=True)``) and the device of each logged tensor;
- notes when each rank's CUDA device becomes current: where Lightning would set it (the
  accelerator's ``setup_device``, which on GPUs calls ``torch.cuda.set_device``) or where user code
  sets it (``torch.cuda.set_device``, seen by the interception), and the object collectives,
  barriers and ``new_group`` collectives made before that;
- at ``on_fit_start``, once Lightning moved the module, places its parameters and buffers on the
  rank's device and its plain tensor attributes on the host (``.to()`` does not move them);
- returns the Trainer config's accelerator, devices, nodes and strategy.

The CUDA devices user code names, ``torch.load`` calls and CUDA calls that cannot run here are the
interception's own events (``cuda_on_cpu``: ``cuda_request``, ``torch_load``, ``cuda_unmapped``).
The probe's events are declared here.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ... import cuda_on_cpu
from ...events import Recorded, declare
from ...runs import Probe
from ...trainer_overrides import on_gpus
from .follow import HOST, DeviceFollower, plain_tensor_attributes, source_line

# -- events --------------------------------------------------------------------------------------

OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
BARRIERS = ("barrier", "monitored_barrier")


class CollectiveEvent(Recorded, total=False):
    """:data:`EV_COLLECTIVE`: ``op``, ``site`` (the user frame that called it; None inside
    Lightning's own sync), ``hook``, ``device`` (where the tensor would be: ``cpu`` or ``cuda:K``),
    ``own`` (the rank's device), ``origin`` (how and where the tensor was made), ``role``."""

    op: str
    site: dict | None
    hook: str | None
    device: str
    own: str
    origin: dict | None
    role: str


class MixEvent(Recorded, total=False):
    """:data:`EV_MIX`: ``api``, ``site``, ``hook``, ``devices`` (as GPU ranks would have them),
    ``why`` (the check that refused it: meta's error, two CUDA devices, a call CUDA does not mix
    devices in), ``origins`` of the tensors involved, ``own``."""

    api: str
    site: dict
    hook: str | None
    devices: list
    why: str
    origins: list
    own: str


class NumpyEvent(Recorded, total=False):
    """:data:`EV_NUMPY`: ``api`` (``Tensor.numpy``, ``Tensor.__array__``), ``site``, ``hook``, ``device``
    the tensor would be on, ``origin``, ``own``."""

    api: str
    site: dict
    hook: str | None
    device: str
    origin: dict | None
    own: str


class UnsyncedEvent(Recorded, total=False):
    """:data:`EV_UNSYNCED`: ``api`` that read the copy, ``site``, ``hook``, ``copy`` (where the
    ``non_blocking=True`` copy to the host was made), ``own``."""

    api: str
    site: dict
    hook: str | None
    copy: dict | None
    own: str


class AttributesEvent(Recorded, total=False):
    """:data:`EV_ATTRIBUTES`: ``attributes`` (``[{"attr", "device", "shape", "origin"}]``, the first
    20) and ``count``."""

    attributes: list
    count: int


class UnsetEvent(Recorded, total=False):
    """:data:`EV_UNSET`: ``op``, ``site``, ``hook``, ``current`` (the index user code set, None when
    none), ``group`` (the backend of a group user code made, None for the default group)."""

    op: str
    site: dict | None
    hook: str | None
    current: int | None
    group: str | None


class SetEvent(Recorded, total=False):
    """:data:`EV_SET`: ``by`` ('lightning': where the accelerator's setup_device would set the GPU)
    and ``index``."""

    by: str
    index: int


class LoadedEvent(Recorded, total=False):
    """:data:`EV_LOADED`: ``config`` (:func:`config_facts` of the Trainer config) and ``world``
    ('cpu' or 'gpu': where the tensors are)."""

    config: dict
    world: str


EV_COLLECTIVE = declare("device_collective", CollectiveEvent)   # a collective got a tensor off the rank's device
EV_MIX = declare("device_mix", MixEvent)                        # a user frame's call mixed tensors of two devices
EV_NUMPY = declare("device_numpy", NumpyEvent)                  # .numpy() of a tensor on the device on GPU ranks
EV_UNSYNCED = declare("device_unsynced", UnsyncedEvent)         # a non_blocking copy read before synchronize
EV_ATTRIBUTES = declare("device_attributes", AttributesEvent)   # the module's plain tensor attributes, at fit start
EV_UNSET = declare("device_unset", UnsetEvent)                  # an object collective before the device is set
EV_SET = declare("device_set", SetEvent)                        # where this rank's CUDA device becomes current
EV_LOADED = declare("device_loaded", LoadedEvent)               # the user's objects are built: what came before
#                                                                 ran at import, in __init__ or in trainer_kwargs


class DevicePlacementProbe(Probe):
    """Rank side of device-placement (see the module docstring)."""

    def __init__(self):
        self.recorder = None
        self.interception = None
        self.follower: DeviceFollower | None = None
        self.lightning_set = False
        self.local_rank = 0
        self.groups: dict[int, str] = {}  # id(process group) -> backend, for the groups user code made
        self._seen: set = set()
        self._undo: list = []
        # Collectives this rank made (outermost, and nested in another) and the tensors they got:
        # on the rank's own device, placed elsewhere, or not placed by the run.
        self.counts = {"collectives": 0, "nested": 0, "own": 0, "off": 0, "unplaced": 0}

    # -- installing ------------------------------------------------------------------------------
    def install(self, recorder) -> None:
        import torch
        import torch.distributed as dist

        self.recorder = recorder
        self.interception = cuda_on_cpu.active()
        ctx_local = self.interception.local_rank if self.interception is not None else 0
        self.local_rank = ctx_local
        if self.interception is not None and self.interception.mapping:
            self.follower = DeviceFollower(ctx_local, self._finding, self.current_index, mimic=False)
            self.interception.observer = self.follower
            self.interception.synchronized.append(self.follower.synchronized)
            recorder.patch(torch, "from_numpy", self._from_numpy)
        recorder.add_call_tap(self._on_call)
        recorder.add_log_tap(self._on_log)
        recorder.patch(dist, "new_group", self._new_group)
        recorder.patch(dist.distributed_c10d, "new_group", self._new_group)

    def current_index(self) -> int:
        """The CUDA index current on this rank now, as on GPU ranks: what user code set, else the
        local rank once Lightning set it, else 0."""
        state = self.interception
        if state is not None and state.current is not None:
            return state.current
        return self.local_rank if self.lightning_set else 0

    def before_trainer(self, objects, trainer_kwargs: dict, recorder) -> None:
        world = "cpu" if self.interception is None or self.interception.mapping else "gpu"
        recorder.emit({"ev": EV_LOADED, "config": config_facts(objects.user_kwargs, self.local_rank), "world": world})
        if self.follower is not None:
            self.follower.mimic = on_gpus(objects.user_kwargs.get("accelerator")) is not None
        trainer_kwargs["callbacks"] = list(trainer_kwargs.get("callbacks") or []) + [_fit_start(objects.ns, self)]

    def before_fit(self, objects, trainer, recorder) -> None:
        accelerator = trainer.strategy.accelerator
        if accelerator is not None:
            original, probe = accelerator.setup_device, self

            def setup_device(device, *args, **kwargs):
                probe.lightning_set = True
                recorder.emit({"ev": EV_SET, "by": "lightning", "index": probe.local_rank})
                return original(device, *args, **kwargs)

            object.__setattr__(accelerator, "setup_device", setup_device)
            self._undo.append(lambda: accelerator.__dict__.pop("setup_device", None))
        if self.follower is not None:
            self.follower.mark_device(trainer.strategy.root_device, self.follower.own)

    # -- what the module does ----------------------------------------------------------------------
    def _finding(self, kind: str, key: tuple, event: dict) -> None:
        """Write a follower's finding once per (kind, key) on this rank."""
        if (kind, key) in self._seen or self.recorder is None:
            return
        self._seen.add((kind, key))
        event = {"ev": {"mix": EV_MIX, "numpy": EV_NUMPY, "unsynced": EV_UNSYNCED}[kind],
                 "hook": self.recorder.current_hook(),
                 "own": f"cuda:{self.local_rank}", **event}
        self.recorder.emit(event)

    def device_of(self, tensor) -> tuple[str | None, dict | None]:
        """``(device, origin)`` a tensor would have on GPU ranks: followed here, real in a GPU world."""
        if self.follower is None:
            device = str(tensor.device)
            return ("cuda:0" if device == "cuda" else device), None
        known = self.follower.tag(tensor)
        return (known[0], known[1]) if known is not None else (None, None)

    def _on_call(self, kind: str, op: str, args: tuple, kwargs: dict, site) -> None:
        if kind != "collective":
            return
        nested = self.recorder.in_call  # inside another traced call (all_gather_object's all_gather)
        if not nested and (op in OBJECT_COLLECTIVES or op in BARRIERS or self._on_user_group(kwargs)):
            self._before_set(op, kwargs, site)
        own = f"cuda:{self.local_rank}"
        self.counts["nested" if nested else "collectives"] += 1
        if op in OBJECT_COLLECTIVES:
            return  # objects are pickled: a tensor inside one travels whatever its device
        for role, tensor in _tensors(args, kwargs):
            device, origin = self.device_of(tensor)
            self.counts["own" if device == own else "unplaced" if device is None else "off"] += 1
            if device is None or device == own:
                continue
            key = ("collective", op, device, _where(origin) or _where(site))
            if key in self._seen:
                continue
            self._seen.add(key)
            event: CollectiveEvent = {"ev": EV_COLLECTIVE, "op": op, "site": site, "hook": self.recorder.current_hook(),
                                      "device": device, "own": own, "origin": origin, "role": role}
            self.recorder.emit(dict(event))

    def _on_user_group(self, kwargs: dict) -> bool:
        group = kwargs.get("group")
        return group is not None and id(group) in self.groups

    def _before_set(self, op: str, kwargs: dict, site) -> None:
        state = self.interception
        if self.lightning_set or (state is not None and state.current is not None and state.current == self.local_rank):
            return
        group = kwargs.get("group")
        backend = self.groups.get(id(group)) if group is not None else None
        if backend == "gloo":
            return  # a gloo group of the user's own: objects go over the CPU there too
        key = ("unset", op, _where(site))
        if key in self._seen:
            return
        self._seen.add(key)
        event: UnsetEvent = {"ev": EV_UNSET, "op": op, "site": site, "hook": self.recorder.current_hook(),
                             "current": state.current if state is not None else None, "group": backend}
        self.recorder.emit(dict(event))

    def _on_log(self, event: dict, value: Any) -> None:
        if event.get("vtype") != "tensor":
            return
        device, origin = self.device_of(value)
        if device is not None:
            event["device"] = device
            event["device_origin"] = origin

    def _new_group(self, original):
        probe = self

        def new_group(*args, **kwargs):
            group = original(*args, **kwargs)
            backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
            with contextlib.suppress(Exception):
                # A "gloo" group stays gloo on GPU ranks only when the source says so: a backend chosen
                # by torch.cuda.is_available() is NCCL there.
                site, _ = cuda_on_cpu.caller_site(2)
                spelled = "gloo" in source_line(site) and "is_available" not in source_line(site)
                probe.groups[id(group)] = "gloo" if str(backend) == "gloo" and spelled else "nccl"
            return group

        return new_group

    def _from_numpy(self, original):
        probe = self

        def from_numpy(array):
            out = original(array)
            follower = probe.follower
            if follower is not None and follower.on:
                site, _ = cuda_on_cpu.caller_site(2)
                if site is not None:
                    follower.place(out, HOST, {"how": "torch.from_numpy", "site": site})
            return out

        return from_numpy

    def at_fit_start(self, pl_module) -> None:
        """Lightning moved the module: its parameters and buffers are on the rank's device; its plain
        tensor attributes stayed where they were made."""
        follower = self.follower
        if follower is None:
            return
        for tensor in (*pl_module.parameters(), *pl_module.buffers()):
            follower.place(tensor, follower.own)
        attributes = []
        for path, tensor in plain_tensor_attributes(pl_module):
            known = follower.tag(tensor)
            device = known[0] if known is not None and known[0] != follower.own else HOST
            origin = {"how": "a plain attribute", "attr": path, "site": (known[1] or {}).get("site") if known else None}
            follower.place(tensor, device, origin)
            attributes.append({"attr": path, "device": device, "shape": list(tensor.shape), "origin": origin})
        if attributes:
            self.recorder.emit({"ev": EV_ATTRIBUTES, "attributes": attributes[:20], "count": len(attributes)})

    def collect(self, objects, trainer, recorder) -> dict:
        for undo in self._undo:
            with contextlib.suppress(Exception):
                undo()
        if self.follower is not None:
            self.follower.on = False
        if self.interception is not None and self.interception.observer is self.follower:
            self.interception.observer = None
        return {**config_facts(objects.user_kwargs, self.local_rank), "counts": dict(self.counts)}


def _fit_start(ns, probe: DevicePlacementProbe):
    class DevicesAtFitStart(ns.Callback):
        def on_fit_start(self, trainer, pl_module):
            with contextlib.suppress(Exception):  # observing must never break the user's run
                probe.at_fit_start(pl_module)

    return DevicesAtFitStart()


def _tensors(args: tuple, kwargs: dict):
    """``(role, tensor)`` for each tensor a collective was given (one level into lists)."""
    import torch

    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, torch.Tensor):
                yield ("a list" if isinstance(value, (list, tuple)) else "the tensor"), item


def _where(thing: dict | None):
    site = (thing or {}).get("site", thing) if thing else None
    return (site.get("file"), site.get("line")) if isinstance(site, dict) and "file" in site else None


def config_facts(user_kwargs: dict, local_rank: int) -> dict:
    """What the user's Trainer config says about the ranks it is written for (plain data)."""
    strategy = user_kwargs.get("strategy")
    start = getattr(strategy, "_start_method", None)
    return {"accelerator": _plain(user_kwargs.get("accelerator")), "devices": _plain(user_kwargs.get("devices")),
            "num_nodes": _plain(user_kwargs.get("num_nodes")), "local_rank": local_rank,
            "strategy": strategy if isinstance(strategy, str) or strategy is None else type(strategy).__name__,
            "start_method": start, "on_gpus": on_gpus(user_kwargs.get("accelerator"))}


def _plain(value):
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return type(value).__name__
