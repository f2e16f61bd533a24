"""The rank-side harness: every run a contract is judged on is made here, on every rank.

A contract declares the run it needs as a :class:`~.runs.RunSpec` (``runs.py``: the pytest-side
interface, pure data); the session submits ``spec.fn`` to a world with one
:class:`~.runs.RunArgs` (the target, the strategy, the contracts' probes as "module:Class"
references, resolved here the way worlds resolve job functions), so this module never imports a
contract. The shared runs' functions are defined here, each ``fn(ctx, args)``:

- :func:`traced_fit`, the traced ``trainer.fit`` every fit-based contract is judged on (``runs.FIT``);
- :func:`inspect`, which loads the user's objects without training (``runs.inspection``).

Runs a contract owns (an evaluation, a one-step run, their one-rank references) live in the
contract's home and build their Trainer through :class:`RankRun`, which loads the user's objects,
adapts the strategy, merges the Trainer kwargs, installs the recorder and its profiler, and calls
the probes' hooks. Rank-side: the pytest side imports ``runs.py`` instead (no torch or Lightning
at module level here either).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from typing import Any

from . import cuda_on_cpu, trainer_overrides
from .events import EXCEPTION, NONFINITE, NOTE, SEEDING, STAGE, STAGE_ERROR, STRATEGY
from .runs import WITHOUT_VALIDATION, Probe, RunArgs
from .seed_watch import watch_env_rank, watch_seeding
from .sites import is_user_file
from .target import loading as target_loading
from .target import spec as target_spec
from .trace import HOOK_PREFIXES, Recorder
from .world.job import resolve
from .world.rank import current_context, stack_path


class UserObjects:
    """The user's objects, loaded inside a rank after the trace is installed: ``model``,
    ``datamodule`` (or None), ``user_kwargs`` (their Trainer kwargs), ``ns`` (the Lightning
    namespace module) and ``target`` (the ``target.spec.ResolvedTarget`` they come from)."""

    def __init__(self, target: target_spec.ResolvedTarget):
        self.target = target
        self.ns = importlib.import_module(target.namespace)
        self.model = self.new_model()
        self.datamodule = self.new_datamodule()
        self.user_kwargs = target_loading.user_trainer_kwargs(target)

    def new_model(self) -> Any:
        """A fresh instance of the user's LightningModule, as their code builds it."""
        return target_loading.instantiate(self.target.model, "LightningModule", "LightningModule", self.target.init)

    def new_datamodule(self) -> Any:
        """A fresh instance of the user's LightningDataModule; None when there is none."""
        if not self.target.datamodule:
            return None
        return target_loading.instantiate(self.target.datamodule, "LightningDataModule", "LightningDataModule")


def _make_profiler(ns: Any, recorder: Recorder):
    base = importlib.import_module(f"{ns.__name__}.profilers").Profiler

    class TraceProfiler(base):
        """Feeds hook entries and exits to the recorder (Lightning profiles every hook). A hook of
        one of the plugin's own callbacks is recorded as ``[Callback]<hook>``: its class is ours,
        and a report that names it would name nothing of the user's."""

        internal: frozenset = frozenset()  # state keys of the plugin's callbacks (set by build_trainer)

        def _named(self, action_name: str) -> str:
            owner, _, hook = action_name[len("[Callback]"):].rpartition(".")
            return f"[Callback]{hook}" if action_name.startswith("[Callback]") and owner in self.internal \
                else action_name

        def start(self, action_name: str) -> None:
            if action_name.startswith(HOOK_PREFIXES):
                recorder.hook_enter(self._named(action_name))

        def stop(self, action_name: str) -> None:
            if action_name.startswith(HOOK_PREFIXES):
                recorder.hook_exit(self._named(action_name))

        def summary(self) -> str:
            return ""

    return TraceProfiler()


def _gpu_strategy(strategies: Any, strategy_name: str, user_strategy: Any, pg_timeout_s: float) -> Any:
    """The GPU tier runs the real strategy class with the user's own configuration: their
    instance when they gave one of that class, else the class (or their registered name)."""
    import datetime

    cls = {"fsdp": strategies.FSDPStrategy, "deepspeed": strategies.DeepSpeedStrategy}[strategy_name]
    if isinstance(user_strategy, cls):
        return user_strategy
    if isinstance(user_strategy, str) and user_strategy.lower().startswith(strategy_name):
        return user_strategy
    return cls(timeout=datetime.timedelta(seconds=pg_timeout_s))


def _ddp_strategy(strategies: Any, user_strategy: Any, pg_timeout_s: float) -> Any:
    import datetime

    if any(k.__name__ == "DeepSpeedStrategy" for k in type(user_strategy).__mro__):
        user_strategy = None  # DeepSpeed needs CUDA: a 'ddp' item runs DDP; strategy-config reads the config
    if isinstance(user_strategy, strategies.DDPStrategy):
        if trainer_overrides.launches_own_ranks(user_strategy):
            kwargs = dict(getattr(user_strategy, "_ddp_kwargs", {}) or {})
            return strategies.DDPStrategy(timeout=datetime.timedelta(seconds=pg_timeout_s), **kwargs)
        return user_strategy
    find_unused = isinstance(user_strategy, str) and "find_unused_parameters_true" in user_strategy
    return strategies.DDPStrategy(find_unused_parameters=find_unused, timeout=datetime.timedelta(seconds=pg_timeout_s))


def tolerate_unused_parameters(strategy: Any) -> bool:
    """Let a DDP run go on past a backward that leaves some parameters without gradient.

    With ``find_unused_parameters=False`` DDP stops the run at the step after such a backward, so
    no contract could observe the rest of it; unused-parameters judges the user's own flag from
    their config, so every other run can take the tolerant one. Sets the flag on ``strategy``'s
    DDP kwargs when it was off (and ``static_graph`` is not used); returns True when it did."""
    ddp_kwargs = getattr(strategy, "_ddp_kwargs", None)
    if not isinstance(ddp_kwargs, dict):
        return False  # not DDP (the sharded tier): the flag does not apply
    if ddp_kwargs.get("find_unused_parameters", False) or ddp_kwargs.get("static_graph", False):
        return False
    ddp_kwargs["find_unused_parameters"] = True
    return True


def adapt_strategy(ns: Any, strategy_name: str, user_strategy: Any, pg_timeout_s: float,
                   accelerator: str | None = None) -> Any:
    """The strategy object a rank of our world runs for ``strategy_name`` ('ddp', 'fsdp' or
    'deepspeed'); raises ValueError for another name.

    'ddp': the user's DDPStrategy instance when they gave one (so find_unused_parameters and
    friends are theirs), else a DDPStrategy that keeps a string's find_unused flag; ddp_spawn
    becomes ddp, since Lightning keeps its own spawn launcher even in externally started ranks.
    """
    strategies = importlib.import_module(f"{ns.__name__}.strategies")
    if strategy_name == "ddp":
        return _ddp_strategy(strategies, user_strategy, pg_timeout_s)
    if strategy_name in ("fsdp", "deepspeed") and (accelerator or _world()[0]) == "gpu":
        return _gpu_strategy(strategies, strategy_name, user_strategy, pg_timeout_s)
    if strategy_name == "fsdp":
        from .sharded import cpu_fsdp_strategy

        return cpu_fsdp_strategy(ns, user_strategy, timeout_s=pg_timeout_s)
    if strategy_name == "deepspeed":
        from .sharded import cpu_deepspeed_strategy

        return cpu_deepspeed_strategy(ns, user_strategy, timeout_s=pg_timeout_s)
    raise ValueError(f"unknown strategy {strategy_name!r}")


def _world() -> tuple[str, int]:
    """(accelerator, num_nodes) from the running job's rank context; CPU on one node outside a job."""
    ctx = current_context()
    return (ctx.accelerator, ctx.num_nodes) if ctx is not None else ("cpu", 1)


RUN_LOGS = "ltconform-logs"


def _run_logger(callback: Any, root: str) -> Any:
    """A CSVLogger in the run's folder that keeps what is logged and writes no file (a file of the
    plugin's own would be judged as the user's), from the Lightning namespace ``callback`` comes from."""
    lightning_cls = next(k for k in type(callback).__mro__ if k.__name__ in trainer_overrides.NEEDS_LOGGER)
    ns = "pytorch_lightning" if lightning_cls.__module__.startswith("pytorch_lightning") else "lightning.pytorch"

    class RunLogger(importlib.import_module(f"{ns}.loggers").CSVLogger):
        def save(self) -> None:
            pass

        def log_hyperparams(self, params: Any = None, *args: Any, **kwargs: Any) -> None:
            pass  # CSVLogger writes hparams.yaml at once, from rank 0: a file judged as the user's

    # A fixed version: every rank names the same folder (a counted one could differ across ranks).
    return RunLogger(save_dir=root, name=RUN_LOGS, version=0)


def build_trainer_kwargs(user: dict, strategy: Any, world_size: int, root: str, *,
                         accelerator: str | None = None, num_nodes: int | None = None) -> dict:
    """Merge the user's Trainer kwargs with what a conformance world needs (its accelerator,
    devices per node and nodes; bounded epochs and batches, no loggers, no progress bars).
    :func:`~.trainer_overrides.overridden` says the same in words: change both together.

    ``accelerator`` and ``num_nodes`` default to the running job's rank context: CPU on one node
    for local CPU worlds, 'gpu' for the GPU tier, the launcher's nodes when attached."""
    default_accelerator, default_nodes = _world()
    accelerator = accelerator or default_accelerator
    num_nodes = num_nodes or default_nodes
    kwargs = dict(user)
    kwargs["max_epochs"] = trainer_overrides.epochs(kwargs.get("max_epochs"))
    kwargs.pop("max_time", None)
    if kwargs.get("max_steps", -1) not in (-1, None):
        kwargs["max_steps"] = trainer_overrides.steps(kwargs["max_steps"])
    for stage in trainer_overrides.STAGES:
        kwargs[f"limit_{stage}_batches"] = trainer_overrides.limit(kwargs.get(f"limit_{stage}_batches"))
    if "callbacks" in kwargs:
        kwargs["callbacks"] = [c for c in trainer_overrides.callback_list(kwargs["callbacks"])
                               if not trainer_overrides.is_progress_bar(c)]
    if getattr(strategy, "ltconform_fp32", False):
        kwargs["precision"] = "32-true"  # half precision under DeepSpeed needs a GPU (see precision_note)
    # Lightning's default checkpoint callback only writes files; the user's own Checkpoint callbacks
    # need enable_checkpointing left on (Lightning refuses them next to False).
    kwargs.setdefault("enable_checkpointing",
                      any(trainer_overrides.is_checkpoint(c) for c in kwargs.get("callbacks") or ()))
    kwargs.setdefault("num_sanity_val_steps", 2)
    if "val_check_interval" in kwargs:
        kwargs["val_check_interval"] = trainer_overrides.val_interval(kwargs["val_check_interval"],
                                                              kwargs["limit_train_batches"])
    kwargs.update(accelerator=accelerator, devices=max(1, world_size // num_nodes), num_nodes=num_nodes,
                  strategy=strategy, default_root_dir=root, **trainer_overrides.FORCED)
    needing = trainer_overrides.needing_logger(kwargs.get("callbacks"))
    if needing:
        kwargs["logger"] = _run_logger(needing[0], root)
    return kwargs


class RankRun:
    """One run on this rank as its probes see it: ``ctx`` (the job's rank context), ``args`` (the
    job's :class:`~.runs.RunArgs`; ``target`` is its target), ``objects`` (the user's objects,
    loaded on first use), ``recorder`` (None in an untraced run), ``probes`` (contract id ->
    Probe) and ``trainer`` once built."""

    def __init__(self, ctx, args: RunArgs, probes: dict[str, Probe], recorder: Recorder | None,
                 exits: contextlib.ExitStack | None = None):
        self.ctx = ctx
        self.args = args
        self.target = args.target
        self.probes = probes
        self.recorder = recorder
        self.trainer = None
        self._exits = exits
        self._optimizers_swapped = False
        self.user_seeds: list[dict] = []  # the user code's calls that seeded a global generator

    @functools.cached_property
    def objects(self) -> UserObjects:
        objects = UserObjects(self.target)
        interception = cuda_on_cpu.active()
        if interception is not None:  # user code asking for the GPU count gets the GPU runner's answer
            interception.gpu_config = trainer_overrides.on_gpus(objects.user_kwargs.get("accelerator")) is not None
        self._cpu_optimizers()
        return objects

    def strategy(self, name: str, user_strategy: Any = None) -> Any:
        """The strategy object for ``name`` (the run's own is ``args.strategy``; see
        :func:`adapt_strategy`), adapting ``user_strategy``."""
        made = adapt_strategy(self.objects.ns, name, user_strategy, self.args.pg_timeout_s)
        self._cpu_optimizers()  # the DeepSpeed strategy has imported deepspeed by now
        return made

    def _cpu_optimizers(self) -> None:
        """On CPU ranks, DeepSpeed's compiled optimizers are built as torch ones for the rest of
        the job (sharded.cpu_optimizers), each substitution said in a note."""
        if self._optimizers_swapped or self._exits is None or _world()[0] != "cpu":
            return
        from .sharded import cpu_optimizers

        if "deepspeed" in sys.modules:
            self._optimizers_swapped = True
            self._exits.enter_context(cpu_optimizers(lambda text: self.emit(NOTE.new(text=text))))

    def trainer_kwargs(self, strategy: Any, user: dict | None = None, world_size: int | None = None) -> dict:
        """The bounded Trainer kwargs of this run: ``user`` (default: the user's own) merged by
        :func:`build_trainer_kwargs` for ``world_size`` ranks (default: this world's)."""
        user = self.objects.user_kwargs if user is None else user
        world_size = self.ctx.world_size if world_size is None else world_size
        return build_trainer_kwargs(user, strategy, world_size, self.ctx.run_dir or self.ctx.job_dir)

    def build_trainer(self, kwargs: dict, callbacks: tuple = ()) -> Any:
        """The Trainer for ``kwargs`` plus ``callbacks``, with the recorder's profiler and the
        probes' ``before_trainer``/``before_fit`` hooks; traced calls are bound to it. A traced
        run also records the first non-finite training loss (:func:`_finite_loss_watch`)."""
        recorder = self.recorder
        watch = (_finite_loss_watch(self.objects.ns, recorder),) if recorder is not None else ()
        kwargs["callbacks"] = list(kwargs.get("callbacks") or []) + list(callbacks) + list(watch) + \
            [_exception_record(self.objects.ns, self)]
        if recorder is not None and kwargs.get("profiler") is None:
            kwargs["profiler"] = _make_profiler(self.objects.ns, recorder)
        for probe in self.probes.values():
            probe.before_trainer(self.objects, kwargs, recorder)
        trainer = self.objects.ns.Trainer(**kwargs)
        if recorder is not None:
            recorder.attach(trainer)
            profiler = kwargs.get("profiler")
            if hasattr(profiler, "internal"):
                profiler.internal = frozenset(cb.state_key for cb in trainer.callbacks
                                              if type(cb).__module__.startswith(__package__ + "."))
        for probe in self.probes.values():
            probe.before_fit(self.objects, trainer, recorder)
        self.trainer = trainer
        return trainer

    def emit(self, event: dict) -> None:
        """Write a trace event (nothing in an untraced run)."""
        if self.recorder is not None:
            self.recorder.emit(event)

    def emit_always(self, event: dict) -> None:
        """Write a trace event, also in an untraced run (appended to this rank's trace file)."""
        if self.recorder is not None:
            self.recorder.emit(event)
            return
        import json

        try:
            with open(self.ctx.trace_path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(event, default=repr) + "\n")
        except OSError:
            pass  # an observation, never a reason for the run to fail

    def after_fit(self) -> None:
        for probe in self.probes.values():
            probe.after_fit(self.objects, self.trainer, self.recorder)

    def collected(self) -> dict:
        """``{contract_id: probe.collect(...)}`` for every probe of the run."""
        return {cid: probe.collect(self.objects, self.trainer, self.recorder) for cid, probe in self.probes.items()}


def _reseed_at_train_start(ns: Any, run: RankRun) -> Any:
    """Under seeding "both": a callback that, when training starts, seeds random, numpy and torch on
    every rank with the job's seed, so that draws made while training (noise that is the sample) are
    judged as under a script that seeds every rank alike, while what was drawn before (a split, a
    subset) was drawn under each rank's own seed. A module that seeded a generator itself keeps it."""
    from .world.rank import seed_generators

    class ReseedAtTrainStart(ns.Callback):
        def on_train_start(self, trainer, pl_module):
            seeded = run.user_seeds
            if seeded:
                run.emit(SEEDING.new(at="train_start", kept=True, by=seeded[0].get("site"), fn=seeded[0].get("fn")))
                return
            seed_generators(run.ctx.base_seed)
            run.emit(SEEDING.new(at="train_start", seed=run.ctx.base_seed))

    return ReseedAtTrainStart()


def _exception_record(ns: Any, run: RankRun) -> Any:
    """A callback that writes the exception a Trainer call raised on this rank as an ``exception``
    event (its type, message, the frame that raised it and the innermost user frame) when
    Lightning's ``on_exception`` runs, before the teardown: a rank that then hangs or dies in the
    teardown's collectives still has its exception named. Traced or not (a plugin's own run too)."""

    class ExceptionRecord(ns.Callback):
        def on_exception(self, trainer, pl_module, exception):
            raised, user = _raise_frames(exception)
            run.emit_always(EXCEPTION.new(exc_type=type(exception).__name__, message=str(exception)[:500],
                                           raised=raised, user=user,
                                           fn=str(getattr(trainer.state, "fn", "") or "")))

    return ExceptionRecord()


def _finite_loss_watch(ns: Any, recorder: Recorder) -> Any:
    """A callback that emits one ``nonfinite`` event at the first training loss that is nan or
    inf on this rank (its value, step, epoch, batch and the user's ``training_step``): values
    compared on top of it mean nothing, and the session says so instead of judging them."""

    class FiniteLossWatch(ns.Callback):
        seen = False
        step = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.step = int(trainer.global_step)  # the optimizer step this batch computes

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if self.seen or not hasattr(loss, "isfinite") or bool(loss.detach().isfinite().all()):
                return
            self.seen = True
            recorder.emit(NONFINITE.new(loss=str(float(loss.detach().float().flatten()[0])), step=self.step,
                                        epoch=int(trainer.current_epoch), batch_idx=int(batch_idx),
                                        site=_step_site(type(pl_module))))

    return FiniteLossWatch()


def training_step_source(cls: type):
    """``(fn, tree, first line, file)`` of ``cls.training_step``'s source parsed with ``ast``; None
    when it has no readable source."""
    import ast
    import inspect
    import textwrap

    fn = getattr(cls, "training_step", None)
    try:
        lines, start = inspect.getsourcelines(fn)
        return fn, ast.parse(textwrap.dedent("".join(lines))), start, inspect.getsourcefile(fn)
    except (TypeError, OSError, SyntaxError):
        return None


def _step_site(cls: type) -> dict | None:
    """The user's ``training_step`` of ``cls`` as a site: its last ``return`` line, else its ``def``;
    named after the class that defines it (a base class of ``cls`` when inherited, with ``for``:
    the class it ran for)."""
    import ast

    source = training_step_source(cls)
    if source is None:
        return None
    _, tree, start, path = source
    returns = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Return) and n.value is not None]
    line = start + (max(returns) if returns else 1) - 1
    owner = next((k for k in cls.__mro__ if "training_step" in vars(k)), cls)
    site = {"file": path, "line": line, "func": f"{owner.__name__}.training_step"}
    if owner is not cls:
        site["for"] = cls.__name__
    return site


@contextlib.contextmanager
def rank_run(ctx, args: RunArgs, *, traced: bool = True, probes=None):
    """The :class:`RankRun` of one job on this rank, for ``args`` (a :class:`~.runs.RunArgs`).
    ``probes`` replaces ``args.probes``: ``[(contract_id, "module:Class")]`` or ``[(contract_id,
    Probe)]``. The job runs inside the CUDA interception (:func:`_interception`), entered first and
    left last (the recorder's and the probes' patches wrap its torch.load). A traced run installs the
    recorder first (so that names the user's module imports are the recording ones), then each
    probe's ``install``; the recorder is removed on exit."""
    recorder = Recorder(ctx.trace_path, ctx.rank) if traced else None
    seeds: list[dict] = []
    with _interception(ctx, recorder) as interception:
        if recorder is not None:
            recorder.watch_collectives(stack_path())
            namespace = args.target.namespace
            namespaces = [namespace] + [ns for ns in target_spec.NAMESPACES if ns != namespace and ns in sys.modules]
            recorder.install(tuple(namespaces))
            seeds = watch_seeding(recorder)
            watch_env_rank(recorder)
        try:
            loaded = {cid: resolve(p)() if isinstance(p, str) else p
                      for cid, p in (args.probes if probes is None else probes)}
            if recorder is not None:
                for probe in loaded.values():
                    probe.install(recorder)
            with contextlib.ExitStack() as exits:
                run = RankRun(ctx, args, loaded, recorder, exits)
                run.user_seeds = seeds
                yield run
        finally:
            if recorder is not None:
                for event in interception.worker_events():
                    recorder.emit(event)
                recorder.uninstall()


def _interception(ctx, recorder: Recorder | None):
    """The job's :func:`~.cuda_on_cpu.intercept`: CUDA calls run on the rank's CPU in a CPU world
    (recorded in a traced run); in a GPU world only recorded."""
    per_node = max(1, ctx.world_size // max(1, ctx.num_nodes))
    return cuda_on_cpu.intercept(ctx.rank, ctx.local_rank, per_node, recorder.emit if recorder is not None else None,
                                 mapping=ctx.accelerator == "cpu", side_path=ctx.trace_path + ".workers",
                                 hook=recorder.current_hook if recorder is not None else None)


def traced_fit(ctx, args: RunArgs, overrides: dict | None = None) -> dict:
    """Run ``trainer.fit`` on this rank with the trace installed, under ``args.strategy``; the run
    every fit-based contract is judged on. ``overrides``: Trainer kwargs set over the bounded
    ones. Returns ``{"probes": {contract_id: observations}}``."""
    from .sharded import configured_for, ddp_note, precision_note

    strategy_name = args.strategy
    with rank_run(ctx, args) as run:
        objects = run.objects
        user_strategy = objects.user_kwargs.get("strategy")
        strategy = run.strategy(strategy_name, user_strategy)
        kwargs = {**run.trainer_kwargs(strategy), **(overrides or {})}
        # What ran in place of the user's strategy (their FSDP/DeepSpeed config as CPU FSDP, or as DDP).
        note = getattr(strategy, "ltconform_note", None) or ddp_note(strategy_name, user_strategy)
        fp32 = precision_note(strategy, objects.user_kwargs.get("precision"))
        note = " ".join(n for n in (note, fp32) if n)
        if note:
            run.emit(NOTE.new(text=note))
        run.emit(STRATEGY.new(configured=configured_for(strategy_name, user_strategy)))
        run.emit(SEEDING.new(at="start", mode=ctx.seeding, seed=ctx.seed))
        reseed = (_reseed_at_train_start(objects.ns, run),) if ctx.seeding == "both" else ()
        trainer = run.build_trainer(kwargs, callbacks=reseed)
        run.emit(STAGE.new(name="fit"))
        trainer.fit(objects.model, datamodule=objects.datamodule)
        # Later stages run traced before the probes' own (untraced) Trainer calls, except on the
        # sharded tier, whose save-and-resume check needs the trainer as fit left it.
        sharded_tier = bool(getattr(strategy, "ltconform_cpu_tier", False))
        if overrides is None and not sharded_tier:
            run_later_stages(run)
        run.after_fit()
        if overrides is None and sharded_tier:
            run_later_stages(run)
        return {"probes": run.collected()}


# Stages run after fit in the same traced world: (trainer method, dataloader hook, step methods).
LATER_STAGES = (("test", "test_dataloader", ("test_step",)),
                ("predict", "predict_dataloader", ("predict_step", "forward")))


def can_run(objects: UserObjects, loader: str, steps: tuple[str, ...]) -> bool:
    """Whether the user's module can run a stage: the ``loader`` hook on the module or its
    datamodule and one of the stage's ``steps`` on the module, each defined by the user as
    Lightning decides it (``lightning_utilities``' ``is_overridden``: a hook set on the instance,
    such as a ``functools.partial`` in ``__init__``, counts)."""
    from lightning_utilities.core.overrides import is_overridden

    ns, model, dm = objects.ns, objects.model, objects.datamodule
    has_loader = is_overridden(loader, model, ns.LightningModule) or (
        dm is not None and is_overridden(loader, dm, ns.LightningDataModule))
    return has_loader and any(is_overridden(s, model, ns.LightningModule) for s in steps)


def later_stages(objects: UserObjects) -> list[str]:
    """The stages after fit the user's module can run (:func:`can_run`)."""
    return [stage for stage, loader, steps in LATER_STAGES if can_run(objects, loader, steps)]


def run_later_stages(run: RankRun) -> None:
    """trainer.test / trainer.predict after fit, traced like fit, so that writes, saves and
    collectives of every stage are judged (the rules' section "Sampling, metrics and writes": rank zero
    alone sees only its shard). A stage that raises is recorded as a ``stage_error`` event and
    ends the later stages on every rank (the ranks agree first, so none waits inside the next)."""
    for stage in later_stages(run.objects):
        run.emit(STAGE.new(name=stage))
        failed = False
        try:
            kwargs = {"verbose": False} if stage == "test" else {}  # a writer needs predict's returned rows
            getattr(run.trainer, stage)(run.objects.model, datamodule=run.objects.datamodule, **kwargs)
        except Exception as exc:  # the user's later stage: evidence, never the end of the fit run
            failed = True
            raised, user = _raise_frames(exc)
            run.emit(STAGE_ERROR.new(name=stage, exc_type=type(exc).__name__, message=str(exc)[:500],
                                     raised=raised, user=user))
        if _any_rank(failed):
            break


def _raise_frames(exc: BaseException) -> tuple[dict | None, dict | None]:
    """(the frame that raised ``exc``, its innermost user frame), as site dicts."""
    import traceback

    frames = [{"file": f.filename, "line": f.lineno, "func": f.name} for f in traceback.extract_tb(exc.__traceback__)]
    user = next((f for f in reversed(frames) if is_user_file(f["file"])), None)
    return (frames[-1] if frames else None), user


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank of the initialised process group (this rank's own
    outside one)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value)
    return value.item() > 0


def traced_fit_without_validation(ctx, args: RunArgs) -> dict:
    """:func:`traced_fit` with no validation loop and no sanity check (``WITHOUT_VALIDATION``)."""
    return traced_fit(ctx, args, overrides=WITHOUT_VALIDATION)


def inspect(ctx, args: RunArgs) -> dict:
    """An untraced run that trains nothing: each probe's :meth:`Probe.inspect`. Returns
    ``{"probes": {contract_id: observations}}``."""
    with rank_run(ctx, args, traced=False) as run:
        return {"probes": {cid: probe.inspect(run) for cid, probe in run.probes.items()}}


_PLAIN = (bool, int, float, str, bytes, type(None))


def batch_leaves(obj, out: list, depth: int = 0) -> None:
    """Tensor and plain-value leaves of a batch, in a stable order. Opaque objects (dataclasses,
    custom classes) are walked through their fields, never hashed by repr (it holds addresses)."""
    import dataclasses

    import torch

    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, _PLAIN):
        out.append(obj)
    elif depth >= 6:
        return
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            batch_leaves(obj[key], out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            batch_leaves(item, out, depth + 1)
    elif type(obj).__module__ == "numpy" and hasattr(obj, "dtype"):
        try:
            out.append(torch.as_tensor(obj))
        except (TypeError, RuntimeError):
            pass
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            batch_leaves(getattr(obj, f.name, None), out, depth + 1)
    elif isinstance(getattr(obj, "__dict__", None), dict):
        attrs = vars(obj)
        for key in sorted(attrs, key=str):
            batch_leaves(attrs[key], out, depth + 1)


def batch_size(batch) -> int | None:
    """The most common leading dimension of a batch's tensors (None without tensors)."""
    import torch

    leaves: list = []
    batch_leaves(batch, leaves)
    dims = [t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not dims:
        return None
    return max(set(dims), key=dims.count)
