"""Rank side: one training step at production size, traced without allocating it.

The user's module is built again under torch's ``FakeTensorMode`` (tensors with shapes and dtypes
but no data), its optimizers come from its own ``configure_optimizers``, the batch is the first one
its train loader gives, grown to the loader's stated ``batch_size``, and the step (training_step,
backward, optimizer step) runs under the Trainer config's precision. Torch's ``MemTracker``
follows every storage the step creates; a first untraced step creates the optimizer state, so the
traced second one sees the state a steady step holds. What cannot be built or stepped this way
raises :class:`CannotTrace` with the reason, and the verdict falls back to the measured run.
"""

from __future__ import annotations

import contextlib
import importlib
import traceback
import warnings
from typing import Any

from ...sharded import sharded_kind, zero_stage
from ...sites import first_sentence


class CannotTrace(Exception):
    """The production step cannot be traced under fake tensors; the message says why."""


def strategy_label(strategy: Any) -> str:
    """How a strategy object is named in the tables: 'DDP', 'FSDP FULL_SHARD', 'DeepSpeed ZeRO-2'."""
    kind = sharded_kind(strategy)
    if kind == "fsdp":
        return f"FSDP {getattr(getattr(strategy, 'sharding_strategy', None), 'name', 'FULL_SHARD')}"
    if kind == "deepspeed":
        return f"DeepSpeed ZeRO-{zero_stage(strategy) or 0}"
    return "DDP"


def configured(user_strategy: Any) -> str:
    """The production strategy's label, as :func:`strategy_label` names it, from the user's config
    (an instance or a registered name; DeepSpeed's default stage is 2, FSDP's FULL_SHARD)."""
    kind = sharded_kind(user_strategy)
    if kind == "deepspeed":
        stage = zero_stage(user_strategy)
        return f"DeepSpeed ZeRO-{2 if stage is None else stage}"
    if kind == "fsdp":
        sharding = getattr(getattr(user_strategy, "sharding_strategy", None), "name", None)
        return f"FSDP {sharding or 'FULL_SHARD'}"
    return "DDP"


def offloads(user_strategy: Any) -> str | None:
    """What the configured strategy moves off the device (CPU or NVMe offload), in words; None
    when nothing. This count does not model offloading, so a verdict on it would be wrong."""
    kind = sharded_kind(user_strategy)
    if isinstance(user_strategy, str):
        return f"strategy={user_strategy!r} offloads to the CPU" if kind and "offload" in user_strategy else None
    if kind == "fsdp":
        offload = getattr(user_strategy, "cpu_offload", None)
        return "FSDPStrategy(cpu_offload=...) offloads parameters to the CPU" \
            if getattr(offload, "offload_params", False) else None
    config = getattr(user_strategy, "config", None) if kind == "deepspeed" else None
    zero = (config or {}).get("zero_optimization") if isinstance(config, dict) else None
    moved = [k for k in ("offload_optimizer", "offload_param") if isinstance((zero or {}).get(k), dict)
             and zero[k].get("device", "cpu") not in (None, "none")]
    verb = "moves" if len(moved) == 1 else "move"
    return f"the DeepSpeed config's {' and '.join(moved)} {verb} state off the device" if moved else None


def production_world(user: dict, run_world: int) -> tuple[int, str | None]:
    """(devices x num_nodes, None) from the Trainer config; the run's world size and why when the
    config does not say a number of devices."""
    devices, nodes = user.get("devices"), user.get("num_nodes", 1)
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    elif isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        return run_world * int(nodes or 1), f"the Trainer config gives devices={devices!r}, not a count"
    return devices * int(nodes or 1), None


_AUTOCAST = {"16-mixed": "float16", "16": "float16", "bf16-mixed": "bfloat16", "bf16": "bfloat16"}
_TRUE = {"bf16-true": "bfloat16", "16-true": "float16", "64-true": "float64", "64": "float64"}
_FP32 = ("32-true", "32", "None")


def _precision(value: Any) -> tuple[str, str | None, str | None]:
    """(the precision's name, autocast dtype, parameter dtype) for a Trainer ``precision``."""
    name = str(value)
    if name in _AUTOCAST:
        return name, _AUTOCAST[name], None
    if name in _TRUE:
        return name, None, _TRUE[name]
    if name in _FP32:
        return "32-true", None, None
    raise CannotTrace(f"precision={value!r} has no fake-tensor equivalent here")


def _first_batch(objects) -> tuple[Any, int | None]:
    """The first batch the user's train loader gives and the loader's stated batch size."""
    source = objects.datamodule if objects.datamodule is not None else objects.model
    loader = source.train_dataloader()
    try:
        batch = next(iter(loader))
    except TypeError as exc:
        raise CannotTrace(f"the train loader ({type(loader).__name__}) cannot be iterated here: {exc}") from None
    stated = getattr(loader, "batch_size", None)
    return batch, stated if isinstance(stated, int) else None


def _mapped(obj: Any, fn, depth: int = 0) -> Any:
    """``obj`` with every tensor replaced by ``fn(tensor)``: through dicts, lists, tuples (named
    ones too) and the attributes of other objects (a dataclass, a graph batch), copied shallowly."""
    import copy

    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if depth >= 6 or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return obj
    if isinstance(obj, dict):
        return {k: _mapped(v, fn, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_mapped(v, fn, depth + 1) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(getattr(obj, "__dict__", None), dict):
        new = copy.copy(obj)
        for key, value in vars(obj).items():
            mapped = _mapped(value, fn, depth + 1)
            if mapped is value:  # unchanged: the copy has it (a graph storage's weakref to its parent)
                continue
            try:
                # The copy's own entry, as vars() read it: a class's __setattr__ may route a name
                # elsewhere (torch_geometric's Data hands '_store' on to its storage).
                vars(new)[key] = mapped
            except (TypeError, AttributeError, ValueError) as exc:
                return _applied(obj, fn, key, exc)
        return new
    return obj


def _applied(obj: Any, fn, key: str, exc: Exception) -> Any:
    """A copy of ``obj`` with ``fn`` applied through its own ``apply`` (torch_geometric's Data and
    Batch have one), for an object whose attributes cannot be set one by one."""
    import copy

    apply = getattr(obj, "apply", None)
    if callable(apply) and not hasattr(obj, "parameters"):  # a Module's apply walks submodules
        new = copy.copy(obj)
        new.apply(fn)
        return new
    raise CannotTrace(f"the batch's {type(obj).__name__} cannot be copied with fake tensors in it: setting its "
                      f"attribute {key!r} on a copy raised {type(exc).__name__}: {first_sentence(str(exc), 160)}, "
                      f"and it has no apply(fn) to map its tensors")


def _leaves(batch) -> list:
    found: list = []
    _mapped(batch, lambda t: found.append(t) or t)
    return found


def _fake_batch(mode, batch: Any, drawn: int | None, stated: int | None) -> Any:
    """``batch`` as fake tensors, with the batch dimension grown from ``drawn`` to ``stated``. Only
    a batch whose tensors all share that leading dimension is grown: rows of a collated graph or a
    packed sequence are not samples, and growing some of them would trace a batch nobody makes."""
    import torch

    grow = bool(drawn and stated and drawn != stated)
    dims = {t.shape[0] for t in _leaves(batch) if t.dim() > 0}
    if grow and dims != {drawn}:
        raise CannotTrace(f"the batch's tensors do not share one batch dimension (leading sizes "
                          f"{sorted(dims)[:4]}), so it cannot be grown to the loader's batch_size={stated}")

    def fake(t):
        if grow and t.dim() > 0:
            with mode:
                return torch.empty((stated, *t.shape[1:]), dtype=t.dtype)
        return mode.from_tensor(t)

    return _mapped(batch, fake)


def _optimizers(ns, model) -> list:
    parse = importlib.import_module(f"{ns.__name__}.core.optimizer")._configure_optimizers
    conf = model.configure_optimizers()
    if conf is None:
        raise CannotTrace("configure_optimizers returns None (a DeepSpeed config's optimizer is not traced)")
    return list(parse(conf)[0])


def _unit(model) -> tuple[str, int]:
    """The largest unit a sharded strategy gathers whole during the step, with a wrap per block:
    the biggest element of a ModuleList/Sequential, or what lies outside the blocks (the root's
    own unit) when that is bigger; without blocks, the whole module (its name, bytes)."""
    import torch

    def size(m):
        return sum(p.numel() * p.element_size() for p in m.parameters())

    blocks = [(f"{name}.{i}", child) for name, mod in model.named_modules()
              if isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)) for i, child in enumerate(mod)]
    if not blocks:
        return "(the whole module)", size(model)
    name, block = max(blocks, key=lambda b: size(b[1]))
    rest = size(model) - sum(size(b) for _, b in blocks)
    return (name, size(block)) if size(block) >= rest else ("(the weights outside the blocks)", rest)


def _step(model, optimizers, batch, autocast: str | None, saved=None) -> None:
    """One training step; ``saved`` (a probe.Activations) counts what its forward saves for backward."""
    import torch

    cast = torch.autocast("cpu", dtype=getattr(torch, autocast)) if autocast else contextlib.nullcontext()
    hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack) if saved is not None \
        else contextlib.nullcontext()
    with cast, hooks:
        out = model.training_step(batch, 0)
    loss = out.get("loss") if isinstance(out, dict) else out
    if not isinstance(loss, torch.Tensor):
        raise CannotTrace("training_step returned no loss tensor")
    loss.backward()
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)


def _state_bytes(model, optimizers) -> dict:
    seen: set = set()

    def total(tensors) -> int:
        n = 0
        for t in tensors:
            st = t.untyped_storage()
            if id(st) not in seen and st.nbytes():
                seen.add(id(st))
                n += st.nbytes()
        return n

    params = total(model.parameters())
    buffers = total(model.buffers())
    state = [v for opt in optimizers for s in opt.state.values() for v in s.values() if hasattr(v, "untyped_storage")]
    return {"params": params, "buffers": buffers, "optimizer": total(state),
            "grads": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)}


# Operators the trace may dispatch (building the module, two steps). A count, not seconds: the
# same module gets the same answer on a loaded CI machine as on a laptop. A 92M-parameter
# transformer's build and two steps (tests/test_memory.py) dispatch about 2,700.
OP_BUDGET = 200_000


def op_budget(limit: int):
    """A dispatch mode that raises :class:`CannotTrace` after ``limit`` operators."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Budget(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            if self.count > limit:
                raise CannotTrace(f"the production step needs more than {limit} operators to trace")
            return func(*args, **(kwargs or {}))

    return _Budget()


def first_batch(objects) -> tuple[Any, int | None]:
    """The first batch of the user's train loader and the loader's stated batch size, once the
    premises hold; raises :class:`CannotTrace`. Drawn in the rank itself (a loader may read the
    process group), before the trace's own process is forked."""
    _precision(objects.user_kwargs.get("precision", "32-true"))
    if not objects.model.automatic_optimization:
        raise CannotTrace("the module steps its own optimizers (manual optimization), which needs a Trainer")
    with _phase("drawing the first batch of the train loader"):
        return _first_batch(objects)


def predict(objects, run_world: int, op_limit: int = OP_BUDGET, first: tuple | None = None) -> dict:
    """The production step's bytes per category (one replica, unsharded) and its setting, traced
    in at most ``op_limit`` dispatched operators; raises :class:`CannotTrace` with the reason.
    ``first``: what :func:`first_batch` gave (drawn here when None)."""
    with op_budget(op_limit):
        return _predict(objects, run_world, first)


def _predict(objects, run_world: int, first: tuple | None) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from .held import Activations

    user = objects.user_kwargs
    precision, autocast, dtype = _precision(user.get("precision", "32-true"))
    world, world_note = production_world(user, run_world)
    if not objects.model.automatic_optimization:
        raise CannotTrace("the module steps its own optimizers (manual optimization), which needs a Trainer")
    batch, stated = first if first is not None else first_batch(objects)
    from ...harness import batch_size

    drawn = batch_size(batch)
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _phase("building the module under fake tensors"), mode:
            model = objects.new_model()
            if hasattr(model, "configure_model"):
                model.configure_model()
            if dtype:
                model = model.to(getattr(__import__("torch"), dtype))
        with _phase("configure_optimizers under fake tensors"), mode:
            optimizers = _optimizers(objects.ns, model)
        with _phase("making the first batch fake"):
            fake = _fake_batch(mode, batch, drawn, stated)
        with _phase("the training step (training_step, backward, optimizer step) on fake tensors"), mode:
            _step(model, optimizers, fake, autocast)  # creates the optimizer state
            tracker = MemTracker()
            tracker.track_external(model, *optimizers, *_leaves(fake))
            saved = Activations()
            with tracker:
                _step(model, optimizers, fake, autocast, saved)
    state = _state_bytes(model, optimizers)
    unit, unit_bytes = _unit(model)
    peak = _peak(tracker)
    # One definition with the measured figures: activations are what the step saved for backward;
    # the rest of the peak above the whole state is temporaries (the loss's gradient, optimizer
    # scratch: Adam's is tracked as optimizer state, so no category is left out), and a predicted
    # total is never below the traced step's own peak.
    beyond_state = peak - sum(state.values())
    return {"bytes": state, "peak": peak, "activations": saved.bytes,
            "temporaries": max(0, beyond_state - saved.bytes),
            "batch": stated or drawn, "drawn": drawn, "precision": precision, "world": world,
            "per_node": max(1, world // int(user.get("num_nodes", 1) or 1)),
            "world_note": world_note, "configured": configured(user.get("strategy")),
            "offload": offloads(user.get("strategy")),
            "optimizers": [type(o).__name__ for o in optimizers], "unit": unit, "unit_bytes": unit_bytes}


@contextlib.contextmanager
def _phase(what: str):
    """Turns what the user's code or torch raised during ``what`` into :class:`CannotTrace`, in
    words, with the user's frame where it stopped."""
    try:
        yield
    except CannotTrace:
        raise
    except Exception as exc:
        raise CannotTrace(stopped(what, exc)) from exc


def stopped(what: str, exc: BaseException) -> str:
    """'<what> stopped at <user file:line (function)>[, in <package file:line (function)>]: <the
    message> (<exception class>)': the innermost frame of the user's own code, then the innermost
    frame of an installed package it called (user code too: docs/internals.md, Sites) where the error
    was raised further in. A TargetError of the rebuild speaks of the target; its cause is what
    the rebuild met."""
    from ...sites import first_sentence, fmt_site, is_installed, is_user_file
    from ...target.spec import TargetError

    cause = exc.__context__ if isinstance(exc, TargetError) and exc.__context__ is not None else exc
    frames = [f for f in traceback.extract_tb(cause.__traceback__) if is_user_file(f.filename)]
    # The user's own line first (their project, not a package installed beside it), then the
    # package's line it went into (safetensors, a model zoo), where those differ.
    own = [f for f in frames if not is_installed(f.filename)]
    named = [f for f in (own[-1] if own else None, frames[-1] if frames else None) if f is not None]
    named = named[:1] if len(named) == 2 and named[0] is named[1] else named
    where = ("at " + ", in ".join(fmt_site({"file": f.filename, "line": f.lineno, "func": f.name}) for f in named)
             if named else "before reaching user code")
    message = first_sentence(str(cause), 240) or "no message"
    said = f"{message} ({type(cause).__name__})"
    plain = _FAKE_LIMITS.get(type(cause).__name__)
    return f"{what} stopped {where}: {f'{plain} ({said})' if plain else said}"


# What fake tensors cannot do, in words, by the exception torch raises for it.
_FAKE_LIMITS = {
    "DataDependentOutputException": "the step reads a tensor's value (an .item(), a bool of a tensor, or a "
                                    "check on values such as torch.distributions' argument validation), and a "
                                    "fake tensor has no values",
    "DynamicOutputShapeException": "the step calls an operator whose output size depends on the values "
                                   "(torch.unique, nonzero, masked_select), which a fake tensor cannot size",
}


def _peak(tracker) -> int:
    """The traced step's peak bytes on its device, every category the tracker names included."""
    snap = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    named = {getattr(k, "name", str(k)): v for k, v in snap.items()}
    return int(named.get("Total", 0))
