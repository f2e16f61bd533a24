"""unused-parameters, rank side: what its probe observes on every rank (the package's docstring says
what the verdict makes of it).
"""

from __future__ import annotations

from ...harness import tolerate_unused_parameters
from ..base import Probe

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
                self.handles.append(p.register_hook(self._grad_hook(full)))
            if own:
                self.handles.append(mod.register_forward_hook(self._forward_hook(mod_name)))
        ddp = getattr(trainer.strategy, "model", None)
        config = {"ev": "grad_setup", "names": self.names, "ddp": False}
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            config.update(ddp=True, find_unused=bool(ddp.find_unused_parameters),
                          static_graph=bool(getattr(ddp, "static_graph", False)))
        self.recorder.emit(config)

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

    def backward_done(self, trainer, site) -> None:
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
        event = {"ev": "grad_use", "n": self.backwards, "k": self.in_batch,
                 "batch": key[1] if key else None, "tracked": len(self.names), "site": site,
                 "unused": unused}
        if unused:
            self.unused_backwards += 1
            event["off"] = [n for n in unused if not self.params[n].requires_grad]
            owners = sorted({self.owner[n] for n in unused})
            event["not_run"] = [m for m in owners if m not in self.ran]
            event["no_grad"] = [m for m in owners if self.ran.get(m) is False]
        self.recorder.emit(event)
        self.seen = set()
        self.ran = {}

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

class UnusedParametersProbe(Probe):
    def __init__(self):
        self.observer = None

    def before_trainer(self, loaded, trainer_kwargs, recorder) -> None:
        if not isinstance(getattr(trainer_kwargs.get("strategy"), "_ddp_kwargs", None), dict):
            return  # not DDP (e.g. the sharded tier): find_unused_parameters does not apply
        observer = self.observer = _Observer(recorder)

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
        recorder.emit({"ev": "grad_config", "user_find_unused": user_flag, "forced": forced})

    def before_fit(self, loaded, trainer, recorder) -> None:
        from ...sites import user_site

        observer = self.observer
        if observer is None:
            return
        strategy = trainer.strategy
        backward = strategy.backward
        on_exception = strategy.on_exception

        def traced_backward(*args, **kwargs):
            site, _ = user_site()
            out = backward(*args, **kwargs)
            try:
                observer.backward_done(trainer, site)
            except Exception as exc:  # recording must never break the user's run
                recorder.emit({"ev": "trace_error", "where": "grad_use", "error": repr(exc)})
            return out

        def traced_on_exception(exception):
            # DDP's own words, before Lightning replaces them with a message without indices.
            if _ddp_error_text(str(exception)):
                recorder.emit({"ev": "ddp_error", "message": str(exception)[:3000]})
            return on_exception(exception)

        object.__setattr__(strategy, "backward", traced_backward)
        object.__setattr__(strategy, "on_exception", traced_on_exception)
        object.__setattr__(strategy, "training_step", _none_watch(strategy.training_step, trainer, recorder))

    def collect(self, loaded, trainer, recorder):
        obs = self.observer
        if obs is None:
            return None
        obs.close()
        return {"backwards": obs.backwards, "unused_backwards": obs.unused_backwards, "tracked": len(obs.names)}

def _none_watch(training_step, trainer, recorder):
    """``strategy.training_step`` that writes a ``step_none`` event (epoch, batch, the user's
    ``return`` line) when the user's step returns None under automatic optimization: Lightning then
    skips backward for that batch on this rank, and with it DDP's gradient all-reduce."""

    def traced(*args, **kwargs):
        out = training_step(*args, **kwargs)
        # Under manual optimization None is the normal return: the step ran its own backward.
        if out is None and trainer.world_size > 1 and trainer.lightning_module.automatic_optimization:
            try:
                recorder.emit({"ev": "step_none", "epoch": int(trainer.current_epoch),
                               "batch": int(trainer.fit_loop.epoch_loop.batch_idx),
                               "site": none_return_site(type(trainer.lightning_module))})
            except Exception as exc:  # recording must never break the user's run
                recorder.emit({"ev": "trace_error", "where": "step_none", "error": repr(exc)})
        return out

    return traced

def none_return_site(cls: type) -> dict | None:
    """Where ``cls.training_step`` returns None: its one ``return`` / ``return None`` (not inside a
    nested function), else, with none, its last line (it falls off the end); with several, the
    first, and ``also`` lists the others."""
    import ast
    import inspect
    import textwrap

    fn = getattr(cls, "training_step", None)
    try:
        lines, start = inspect.getsourcelines(fn)
        tree = ast.parse(textwrap.dedent("".join(lines)))
        path = inspect.getsourcefile(fn)
    except (TypeError, OSError, SyntaxError):
        return None
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
