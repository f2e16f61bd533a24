"""unused-parameters, rank side: what its probe observes on every rank (the package's docstring says
what the verdict makes of it).

- Where each parameter was built: the innermost user frame when its module registered it
  (``Module.register_parameter``, tapped from before the user's module is built), so that an
  ``nn.Linear`` built inside ``Encoder.__init__`` is located there, not at ``self.encoder = ...``.
- Which parameters each forward used: every torch function call made inside ``training_step`` is
  seen by a :class:`torch.overrides.TorchFunctionMode` that notes the tracked parameters among its
  arguments, and whether grad mode was on. A module ran when its parameters were used, whether or
  not its hooks fired (``self.head.forward(x)`` bypasses them).
- Where ``requires_grad`` was switched off: ``Parameter.requires_grad`` and ``requires_grad_`` are
  watched during the run, with the user's frame and the library function it went through
  (``LightningModule.toggle_optimizer``, ``Module.requires_grad_``), recorded, never guessed.
"""

from __future__ import annotations

import sys

from ...events import TRACE_ERROR, Recorded, declare
from ...harness import tolerate_unused_parameters, training_step_source
from ...sites import is_user_file, user_site
from ..base import Probe


class GradSetupEvent(Recorded):
    """The parameters tracked (``names``) and the DDP wrapper's flags (``ddp``, ``find_unused``, ``static_graph``)."""

    names: list
    ddp: bool
    find_unused: bool
    static_graph: bool


class GradUseEvent(Recorded):
    """Backward ``n`` (``k`` of its batch ``batch``): the ``unused`` of the ``tracked`` parameters, at ``site``."""

    n: int
    k: int
    batch: int | None
    tracked: int
    site: dict | None
    unused: list


class GradConfigEvent(Recorded):
    """The user's find_unused_parameters (``user_find_unused``) and whether the run forced it on (``forced``)."""

    user_find_unused: bool | None
    forced: bool


class DdpErrorEvent(Recorded):
    """DDP's own error ``message`` (with the parameter indices), before Lightning rewords it."""

    message: str


class StepNoneEvent(Recorded):
    """training_step returned None at ``batch`` of ``epoch`` (``site``: the return)."""

    batch: int
    site: dict | None


GRAD_SETUP = declare("grad_setup", GradSetupEvent)
GRAD_USE = declare("grad_use", GradUseEvent)
GRAD_CONFIG = declare("grad_config", GradConfigEvent)
DDP_ERROR = declare("ddp_error", DdpErrorEvent)
STEP_NONE = declare("step_none", StepNoneEvent)

_DDP_ERROR_PATTERNS = (
    "Expected to have finished reduction",
    "parameters that were not used in producing the loss",
    "did not receive grad",
)

def _ddp_error_text(message: str | None) -> bool:
    return bool(message) and any(p in message for p in _DDP_ERROR_PATTERNS)

class _Observer:
    """Rank side: per-parameter gradient hooks and the per-backward record."""

    def __init__(self, recorder):
        self.recorder = recorder
        self.names: list[str] = []
        self.params: dict[str, object] = {}
        self.seen: set[str] = set()
        self.ran: dict[str, bool] = {}          # module name -> ran with grad enabled at least once
        self.owner: dict[str, str] = {}         # parameter name -> owning module name
        self.handles: list = []
        self.backwards = 0
        self.batch_key = None
        self.in_batch = 0
        self.unused_backwards = 0
        self.started = False
        self.built: dict[str, dict] = {}        # parameter name -> where the user's code built it
        self.used: dict[int, bool] = {}         # id(parameter) -> used with grad enabled (this backward's forward)
        self.switched: dict[int, dict] = {}     # id(parameter) -> its last recorded switch of requires_grad off
        self.ids: dict[int, str] = {}           # id(parameter) -> name, for the tracked ones
        self.sites = None                       # parameter -> where it was built (the probe's, from install)
        self.watching = False                   # whether the forward's parameter use is recorded

    def start(self, trainer) -> None:
        import torch

        if self.started:
            return
        self.started = True
        module = trainer.lightning_module
        # The order DDP gives its reducer: modules in named_modules order, each module's own
        # parameters that require grad, first occurrence of a shared parameter only.
        seen_ids = set()
        for mod_name, mod in module.named_modules():
            own = [(n, p) for n, p in mod.named_parameters(recurse=False) if p.requires_grad]
            for pname, p in own:
                if id(p) in seen_ids:
                    continue
                seen_ids.add(id(p))
                full = f"{mod_name}.{pname}" if mod_name else pname
                self.names.append(full)
                self.params[full] = p
                self.owner[full] = mod_name
                self.ids[id(p)] = full
                self.handles.append(p.register_hook(self._grad_hook(full)))
            if own:
                self.handles.append(mod.register_forward_hook(self._forward_hook(mod_name)))
        ddp = getattr(trainer.strategy, "model", None)
        config = {"ev": GRAD_SETUP, "names": self.names, "ddp": False, "built": self.built_sites()}
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            config.update(ddp=True, find_unused=bool(ddp.find_unused_parameters),
                          static_graph=bool(getattr(ddp, "static_graph", False)))
        self.recorder.emit(config)

    def built_sites(self) -> dict[str, dict]:
        """Parameter name -> the user frame that built it, for the tracked parameters recorded."""
        sites = getattr(self, "sites", None)
        if sites is None:
            return {}
        return {n: sites[p] for n, p in self.params.items() if p in sites}

    def note_use(self, param, grad_enabled: bool) -> None:
        key = id(param)
        if key in self.ids:
            self.used[key] = self.used.get(key, False) or grad_enabled

    def note_switch(self, param, value: bool) -> None:
        """A tracked parameter's requires_grad set to ``value``: its user frame and library call."""
        if id(param) not in self.ids or value:
            return
        site, _ = user_site(depth=3)
        self.switched[id(param)] = {"site": site, "via": _library_call(sys._getframe(2))}

    def _usage(self, owners: list[str]) -> dict[str, dict]:
        """Per owning module: whether any of its parameters was used in this forward (None when
        parameter use was not recorded), with grad enabled, and whether its forward hook fired."""
        out = {}
        for m in owners:
            ids = [id(p) for n, p in self.params.items() if self.owner[n] == m]
            seen = [self.used[i] for i in ids if i in self.used]
            out[m] = {"used": bool(seen) if self.watching else None, "grad": any(seen), "hooks": m in self.ran}
        return out

    def _grad_hook(self, name: str):
        def hook(grad):
            self.seen.add(name)
            return None

        return hook

    def _forward_hook(self, name: str):
        import torch

        def hook(module, args, output):
            self.ran[name] = self.ran.get(name, False) or torch.is_grad_enabled()

        return hook

    def backward_done(self, trainer, site, outside: bool = False) -> None:
        if not self.started:
            return
        self.backwards += 1
        try:
            key = (int(trainer.current_epoch), int(trainer.fit_loop.epoch_loop.batch_idx))
        except Exception:
            key = None
        if key != self.batch_key:
            self.batch_key, self.in_batch = key, 0
        self.in_batch += 1
        unused = [n for n in self.names if n not in self.seen]
        event = {"ev": GRAD_USE, "n": self.backwards, "k": self.in_batch,
                 "batch": key[1] if key else None, "tracked": len(self.names), "site": site,
                 "unused": unused, "outside": outside}
        if outside:  # under manual optimization only manual_backward prepares DDP's reducer for a backward
            event["manual"] = not getattr(trainer.lightning_module, "automatic_optimization", True)
        if unused:
            self.unused_backwards += 1
            event["off"] = [n for n in unused if not self.params[n].requires_grad]
            event["off_at"] = {n: self.switched.get(id(self.params[n])) for n in event["off"]}
            owners = sorted({self.owner[n] for n in unused})
            usage = event["usage"] = self._usage(owners)
            # Ran or not is decided by the parameters' use (hooks are bypassed by module.forward(x)).
            if self.watching:
                event["not_run"] = [m for m in owners if usage[m]["used"] is False]
                event["no_grad"] = [m for m in owners if usage[m]["used"] and not usage[m]["grad"]]
            else:
                event["not_run"], event["no_grad"] = [], [m for m in owners if self.ran.get(m) is False]
        self.recorder.emit(event)
        self.seen = set()
        self.ran = {}
        self.used = {}

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

def _library_call(frame) -> str | None:
    """The outermost library function between a watched switch and the user's frame that called it
    (``LightningModule.toggle_optimizer``, ``Module.requires_grad_``); None when the user's code set
    the flag itself."""
    found = None
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        code = frame.f_code
        if "pytest_ltconform" not in code.co_filename:
            found = getattr(code, "co_qualname", code.co_name)
        frame = frame.f_back
    return found


def _param_use_mode(observer):
    """A TorchFunctionMode that notes every tracked parameter a torch function receives (directly,
    or in a list or tuple argument), and whether grad mode was on."""
    import torch
    from torch.nn import Parameter

    compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)

    class ParameterUse(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if compiling():  # inside a torch.compile trace: leave the graph as the user's code makes it
                return func(*args, **kwargs)
            try:
                enabled = torch.is_grad_enabled()
                for arg in (*args, *kwargs.values()):
                    for a in (arg if isinstance(arg, (list, tuple)) else (arg,)):
                        if isinstance(a, Parameter):
                            observer.note_use(a, enabled)
            except Exception:  # an observation: never the user's forward's failure
                pass
            return func(*args, **kwargs)

    return ParameterUse


class UnusedParametersProbe(Probe):
    def __init__(self):
        self.observer = None
        self.sites = None

    def install(self, recorder) -> None:
        """Note where the user's code builds each parameter (before the module is built)."""
        import torch
        from torch.utils.weak import WeakIdKeyDictionary

        sites = self.sites = WeakIdKeyDictionary()

        def factory(original):
            def register_parameter(module, name, param):
                out = original(module, name, param)
                if param is not None and param not in sites:
                    try:
                        site, _ = user_site()
                        if site is not None:
                            sites[param] = site
                    except Exception:  # an observation: never the user's construction's failure
                        pass
                return out

            return register_parameter

        recorder.patch(torch.nn.Module, "register_parameter", factory)

    def before_trainer(self, loaded, trainer_kwargs, recorder) -> None:
        if not isinstance(getattr(trainer_kwargs.get("strategy"), "_ddp_kwargs", None), dict):
            return  # not DDP (e.g. the sharded tier): find_unused_parameters does not apply
        observer = self.observer = _Observer(recorder)
        observer.sites = self.sites
        observer.watching = False
        _watch_requires_grad(recorder, observer)

        class GradUse(loaded.ns.Callback):
            def on_train_start(self, trainer, pl_module):
                observer.start(trainer)

        trainer_kwargs["callbacks"] = list(trainer_kwargs.get("callbacks") or []) + [GradUse()]
        # With the user's find_unused_parameters=False, DDP's reducer stops the run at the step after
        # the first incomplete backward, so later backward passes (and every other contract) would go
        # unseen. The run observes with the flag on and the verdict judges the user's own setting.
        strategy = trainer_kwargs.get("strategy")
        user_flag = bool(strategy._ddp_kwargs.get("find_unused_parameters", False))
        forced = tolerate_unused_parameters(strategy)
        recorder.emit({"ev": GRAD_CONFIG, "user_find_unused": user_flag, "forced": forced})

    def before_fit(self, loaded, trainer, recorder) -> None:
        from ...sites import user_site

        observer = self.observer
        if observer is None:
            return
        strategy = trainer.strategy
        backward = strategy.backward
        on_exception = strategy.on_exception

        inside = [0]  # in Lightning's backward: the tensor's backward under it is that one

        def traced_backward(*args, **kwargs):
            site, _ = user_site()
            inside[0] += 1
            try:
                out = backward(*args, **kwargs)
            finally:
                inside[0] -= 1
            try:
                observer.backward_done(trainer, site)
            except Exception as exc:  # recording must never break the user's run
                recorder.emit({"ev": TRACE_ERROR, "where": "grad_use", "error": repr(exc)})
            return out

        def traced_on_exception(exception):
            # DDP's own words, before Lightning replaces them with a message without indices.
            if _ddp_error_text(str(exception)):
                recorder.emit({"ev": DDP_ERROR, "message": str(exception)[:3000]})
            return on_exception(exception)

        object.__setattr__(strategy, "backward", traced_backward)
        _watch_plain_backward(recorder, observer, trainer, inside)
        object.__setattr__(strategy, "on_exception", traced_on_exception)
        step = _none_watch(strategy.training_step, trainer, recorder)
        object.__setattr__(strategy, "training_step", _with_param_use(step, observer))

    def collect(self, loaded, trainer, recorder):
        obs = self.observer
        if obs is None:
            return None
        obs.close()
        return {"backwards": obs.backwards, "unused_backwards": obs.unused_backwards, "tracked": len(obs.names)}

def _watch_plain_backward(recorder, observer, trainer, inside: list) -> None:
    """A backward the user's code runs itself (``loss.backward()``, ``torch.autograd.backward``),
    outside Lightning's ``strategy.backward``, is a backward pass too: recorded the same way, at
    the user's line (``outside``)."""
    import torch

    from ...sites import user_site

    def factory(original):
        def backward(*args, **kwargs):
            if inside[0] or not observer.started:
                return original(*args, **kwargs)
            site, _ = user_site()
            inside[0] += 1
            try:
                out = original(*args, **kwargs)
            finally:
                inside[0] -= 1
            try:
                observer.backward_done(trainer, site, outside=True)
            except Exception as exc:  # recording must never break the user's run
                recorder.emit({"ev": TRACE_ERROR, "where": "grad_use", "error": repr(exc)})
            return out

        return backward

    recorder.patch(torch.Tensor, "backward", factory)
    recorder.patch(torch.autograd, "backward", factory)


def _with_param_use(training_step, observer):
    """``training_step`` run under the parameter-use mode (its forward is where parameters are used;
    a manual backward inside it ends a record as an automatic one after it does)."""
    try:
        mode = _param_use_mode(observer)
        observer.watching = True
    except Exception:
        return training_step

    def traced(*args, **kwargs):
        with mode():
            return training_step(*args, **kwargs)

    return traced


def _watch_requires_grad(recorder, observer) -> None:
    """Watch ``Parameter.requires_grad = ...`` and ``requires_grad_(...)`` for the run."""
    import torch

    base = torch._C.TensorBase.requires_grad

    class Watched(property):
        pass

    def setter(param, value):
        observer.note_switch(param, bool(value))
        base.__set__(param, value)

    def method(original):
        def requires_grad_(param, requires_grad=True):
            observer.note_switch(param, bool(requires_grad))
            return original(param, requires_grad)

        return requires_grad_

    recorder.patch(torch.nn.Parameter, "requires_grad", lambda _: Watched(base.__get__, setter), inherited=True)
    recorder.patch(torch.nn.Parameter, "requires_grad_", method, inherited=True)


def _none_watch(training_step, trainer, recorder):
    """``strategy.training_step`` that writes a ``step_none`` event (epoch, batch, the user's
    ``return`` line) when the user's step returns None under automatic optimization: Lightning then
    skips backward for that batch on this rank, and with it DDP's gradient all-reduce."""

    def traced(*args, **kwargs):
        out = training_step(*args, **kwargs)
        # Under manual optimization None is the normal return: the step ran its own backward.
        if out is None and trainer.world_size > 1 and trainer.lightning_module.automatic_optimization:
            try:
                recorder.emit({"ev": STEP_NONE, "epoch": int(trainer.current_epoch),
                               "batch": int(trainer.fit_loop.epoch_loop.batch_idx),
                               "site": none_return_site(type(trainer.lightning_module))})
            except Exception as exc:  # recording must never break the user's run
                recorder.emit({"ev": TRACE_ERROR, "where": "step_none", "error": repr(exc)})
        return out

    return traced

def none_return_site(cls: type) -> dict | None:
    """Where ``cls.training_step`` returns None: its one ``return`` / ``return None`` (not inside a
    nested function), else, with none, its last line (it falls off the end); with several, the
    first, and ``also`` lists the others."""
    import ast

    source = training_step_source(cls)
    if source is None:
        return None
    fn, tree, start, path = source
    body = tree.body[0] if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    if body is None:
        return None
    found, todo = [], list(ast.iter_child_nodes(body))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Return) and (node.value is None or (isinstance(node.value, ast.Constant)
                                                                     and node.value.value is None)):
            found.append(start + node.lineno - 1)
        todo.extend(ast.iter_child_nodes(node))
    found.sort()
    line = found[0] if found else start + (body.end_lineno or body.lineno) - 1
    return {"file": path, "line": line, "func": f"{fn.__qualname__}", "also": found[1:]}
