"""The sharded tiers on CPU: Lightning's FSDPStrategy and DeepSpeedStrategy on gloo ranks, and
reading DeepSpeed configs where the deepspeed package is not installed.

Lightning 2.6.6 refuses FSDP without a GPU by an exact type check on the strategy, and torch FSDP
only accepts CPU modules when it is given ``device_id=torch.device("cpu")``. A subclass of the
namespace's FSDPStrategy passes the first and supplies the second, so sharded saves, sharded
resume and ``configure_model`` inside the sharded context all run for real on CPU ranks.

Lightning also refuses DeepSpeed without CUDA; a DeepSpeedStrategy subclass skips that check,
keeps DeepSpeed's process group on gloo and gives the engine a CPU device with an index, so the
user's own ZeRO stage and config run for real (what CPU cannot run, fused optimizers, offload and
half precision, is replaced by its nearest equivalent and said in the item's note). Where the
deepspeed package is not installed at all, :func:`deepspeed_stand_in` lets the user's
``DeepSpeedStrategy(...)`` be constructed so its settings (stage, config dict) can still be read.

No torch or lightning import at module level: the pytest process imports this module lazily.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
from typing import Any

# DeepSpeed ZeRO stage -> the FSDP sharding strategy that shards the same state.
_ZERO_TO_FSDP = {0: "NO_SHARD", 1: "SHARD_GRAD_OP", 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}
# FSDPStrategy kwargs that only make sense on GPUs and are dropped on CPU ranks.
_GPU_ONLY_KWARGS = ("device_mesh",)
# Sharding strategies that shard within a node and replicate across nodes (a 2-D device mesh).
HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def world_layout() -> tuple[int, int]:
    """(nodes, ranks per node) of the running job's world (one node of one rank outside a job)."""
    from .world.rank import current_context

    ctx = current_context()
    if ctx is None:
        return 1, 1
    nodes = max(1, int(ctx.num_nodes or 1))
    return nodes, max(1, ctx.world_size // nodes)


def cpu_mesh(shape: tuple[int, int]):
    """A 2-D device mesh on CPU (replicate across nodes, shard within one) for the job's process
    group: what Lightning's FSDPStrategy would build with ``init_device_mesh("cuda", shape)``."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _hybrid_settings(strategy, settings: dict) -> None:
    """A hybrid sharding on CPU ranks (in place on the FSDP ``settings`` of ``strategy``): on one
    node a CPU mesh of 1 x its ranks; across nodes FULL_SHARD (the item's note says so): with one
    rank per node a shard group of one rank is NO_SHARD without the all-reduce across nodes, and a
    CPU mesh of several ranks per node did not resume its own sharded checkpoint here."""
    nodes, per_node = world_layout()
    if nodes > 1:
        from torch.distributed.fsdp import ShardingStrategy

        settings["sharding_strategy"] = ShardingStrategy.FULL_SHARD
        return
    if strategy.ltconform_mesh is None:
        strategy.ltconform_mesh = cpu_mesh((nodes, per_node))
    settings["device_mesh"] = strategy.ltconform_mesh


def sharded_kind(user_strategy: Any) -> str | None:
    """'fsdp', 'deepspeed' or None: which sharded strategy the user's Trainer config names
    (an instance, a subclass instance, or a registered name such as 'fsdp_cpu_offload')."""
    if user_strategy is None:
        return None
    if isinstance(user_strategy, str):
        name = user_strategy.lower()
        if name.startswith("fsdp"):
            return "fsdp"
        if name.startswith("deepspeed"):
            return "deepspeed"
        return None
    for klass in type(user_strategy).__mro__:
        if klass.__name__ == "FSDPStrategy":
            return "fsdp"
        if klass.__name__ == "DeepSpeedStrategy":
            return "deepspeed"
    return None


def saved_layout(user_strategy: Any) -> str:
    """What a ``Trainer.save_checkpoint`` under the user's strategy writes: 'deepspeed' (a ZeRO
    checkpoint directory), 'fsdp' (a sharded directory: FSDP with state_dict_type='sharded') or
    'file' (one checkpoint file: every other strategy, and FSDP's default 'full')."""
    kind = sharded_kind(user_strategy)
    if kind == "fsdp" and getattr(user_strategy, "_state_dict_type", "full") == "sharded":
        return "fsdp"
    return "deepspeed" if kind == "deepspeed" else "file"


def zero_stage(user_strategy: Any) -> int | None:
    """The ZeRO stage a DeepSpeedStrategy (or a 'deepspeed_stage_N' name) asks for."""
    if isinstance(user_strategy, str):
        digits = [c for c in user_strategy if c.isdigit()]
        return int(digits[0]) if digits else None
    config = getattr(user_strategy, "config", None) or {}
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    if isinstance(zero, dict) and "stage" in zero:
        try:
            return int(zero["stage"])
        except (TypeError, ValueError):
            return None
    return None


def describe(user_strategy: Any) -> str:
    """Short readable form of the user's strategy, e.g. ``FSDPStrategy(state_dict_type='sharded')``."""
    if isinstance(user_strategy, str):
        return repr(user_strategy)
    kind = sharded_kind(user_strategy)
    # The Lightning class, not the plugin's CPU subclass of it that an item runs.
    name = next(k.__name__ for k in type(user_strategy).__mro__ if not k.__module__.startswith(__package__))
    if kind == "deepspeed":
        stage = zero_stage(user_strategy)
        return f"{name}(stage={stage})" if stage is not None else f"{name}(config=...)"
    if kind == "fsdp":
        parts = []
        sdt = getattr(user_strategy, "_state_dict_type", "full")
        if sdt != "full":
            parts.append(f"state_dict_type={sdt!r}")
        sharding = getattr(getattr(user_strategy, "sharding_strategy", None), "name", None)
        if sharding and sharding != "FULL_SHARD":
            parts.append(f"sharding_strategy={sharding!r}")
        if "auto_wrap_policy" in (getattr(user_strategy, "kwargs", None) or {}):
            parts.append("auto_wrap_policy=...")
        return f"{name}({', '.join(parts)})"
    return name


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


class _FullStateOnCPU:
    """The CPU FSDP strategy's state_dict_type='full' (Lightning's default): gathered without
    offload_to_cpu (see :func:`_full_state_on_cpu`)."""

    def lightning_module_state_dict(self):
        with _full_state_on_cpu(type(self)):
            return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer):
        with _full_state_on_cpu(type(self)):
            return super().optimizer_state(optimizer)

    def load_checkpoint(self, *args, **kwargs):
        with _full_state_on_cpu(type(self)):
            return super().load_checkpoint(*args, **kwargs)


def _cpu_subclass(base: type) -> type:
    import contextlib as _ctx

    import torch

    cpu = torch.device("cpu")

    class CPUFSDPStrategy(_FullStateOnCPU, base):
        """FSDPStrategy on CPU gloo ranks: FSDP units get ``device_id=cpu``."""

        ltconform_cpu_tier = True
        ltconform_mesh = None  # the CPU device mesh of a hybrid sharding, made once the group exists

        def _fsdp_settings(self) -> dict:
            settings = dict(cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
                            sharding_strategy=self.sharding_strategy, device_id=cpu, **self.kwargs)
            if getattr(self.sharding_strategy, "name", None) in HYBRID:
                _hybrid_settings(self, settings)
            return settings

        def _setup_model(self, model):
            from torch.distributed.fsdp import FullyShardedDataParallel

            root = getattr(self, "_ltconform_root", None)
            if root is not None and root.module is model:
                # validate/test/predict after fit on the same Trainer: the module's parameters are
                # still views into the shards of fit's wrapper (1-D), which a second wrapper would
                # flatten as they are ('weight' must be 2-D): keep fit's wrapper, which gathers them.
                model = root
            elif not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
                model = FullyShardedDataParallel(module=model, **self._fsdp_settings())
            self._ltconform_root = model if isinstance(model, FullyShardedDataParallel) else None
            # The model is wrapped now, so Lightning's own setup only does its after-wrap steps
            # (TorchMetrics placement, activation checkpointing). Hide the wrap policy meanwhile:
            # Lightning would warn about it and delete it for the next stage (validate after fit).
            policy = self.kwargs.pop("auto_wrap_policy", None)
            try:
                return super()._setup_model(model)
            finally:
                if policy is not None:
                    self.kwargs["auto_wrap_policy"] = policy

        @_ctx.contextmanager
        def model_sharded_context(self):
            # configure_model runs in here: wrap() calls in it build CPU FSDP units.
            from torch.distributed.fsdp import FullyShardedDataParallel
            from torch.distributed.fsdp.wrap import enable_wrap

            with enable_wrap(wrapper_cls=FullyShardedDataParallel, **self._fsdp_settings()):
                yield

    CPUFSDPStrategy.__qualname__ = f"CPU{base.__qualname__}"
    return CPUFSDPStrategy


@contextlib.contextmanager
def _full_state_on_cpu(strategy_cls: type):
    """While active, the full-state-dict context of the Lightning module that defines
    ``strategy_cls``'s FSDPStrategy gathers without offloading to CPU: the tensors are on CPU
    already, and torch 2.13's offload path crashes a CPU gloo rank (measured: SIGSEGV on rank 0 in
    FSDP.optim_state_dict with FullOptimStateDictConfig(offload_to_cpu=True), also through
    torch.distributed.checkpoint's get_state_dict(cpu_offload=True); without it both ranks finish)."""
    owner = next((sys.modules.get(k.__module__) for k in strategy_cls.__mro__ if k.__name__ == "FSDPStrategy"
                  and k.__module__.endswith(".strategies.fsdp")), None)
    original = getattr(owner, "_get_full_state_dict_context", None)
    if original is None:
        yield
        return

    def full_context(module, world_size: int, rank0_only: bool = True):
        from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP.state_dict_type(module=module, state_dict_type=StateDictType.FULL_STATE_DICT,
                                    state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
                                    optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False,
                                                                                     rank0_only=rank0_only))

    owner._get_full_state_dict_context = full_context
    try:
        yield
    finally:
        owner._get_full_state_dict_context = original


def cpu_fsdp_strategy(ns: Any, user_strategy: Any = None, timeout_s: float | None = None) -> Any:
    """An FSDPStrategy of namespace ``ns`` (``lightning.pytorch`` or ``pytorch_lightning``) that
    trains on CPU gloo ranks.

    Keeps the user's settings when ``user_strategy`` is an FSDPStrategy (state_dict_type,
    auto_wrap_policy, sharding_strategy, activation checkpointing, their own subclass'
    overrides); a registered name ('fsdp', 'fsdp_cpu_offload') gets its registered settings; a
    DeepSpeedStrategy gets the FSDP sharding that matches its ZeRO stage; anything else the
    defaults. ``timeout_s`` bounds every collective (seconds). The returned object carries
    ``ltconform_note``: one sentence saying what ran in place of the user's config.
    """
    import datetime

    strategies = importlib.import_module(f"{ns.__name__}.strategies")
    base = strategies.FSDPStrategy
    kind = sharded_kind(user_strategy)
    if kind == "fsdp" and isinstance(user_strategy, base):
        cls = _cpu_subclass(type(user_strategy))
        strategy = cls.__new__(cls)
        strategy.__dict__.update(user_strategy.__dict__)
        strategy.kwargs = {k: v for k, v in dict(user_strategy.kwargs).items() if k not in _GPU_ONLY_KWARGS}
    else:
        init: dict = {}
        if kind == "fsdp" and isinstance(user_strategy, str):
            registry = strategies.StrategyRegistry  # its .get() builds the strategy; we want the settings
            entry = registry[user_strategy] if user_strategy in registry else {}
            init = dict(entry.get("init_params") or {})
        elif kind == "deepspeed":
            stage = zero_stage(user_strategy)
            init = {"sharding_strategy": _ZERO_TO_FSDP.get(stage if stage is not None else 2, "FULL_SHARD")}
        strategy = _cpu_subclass(base)(**init)
    if timeout_s is not None:
        strategy._timeout = datetime.timedelta(seconds=timeout_s)
    where = "a GPU is present, but this is the CPU tier" if _cuda_available() else "no GPU is present"
    sharding = getattr(getattr(strategy, "sharding_strategy", None), "name", "FULL_SHARD")
    hybrid = _hybrid_note(user_strategy, sharding)
    if kind == "fsdp":
        strategy.ltconform_note = (
            f"the Trainer config names {describe(user_strategy)}; {where}, so this item ran it as "
            f"FSDP on CPU gloo ranks (the CPU sharded tier) with your settings "
            f"(sharding {sharding}, state_dict_type={strategy._state_dict_type!r}).{hybrid}")
    elif kind == "deepspeed":
        strategy.ltconform_note = (
            f"the Trainer config names {describe(user_strategy)}; DeepSpeed under Lightning needs CUDA and "
            f"{where}, so this item ran the CPU sharded tier instead: FSDP on CPU gloo ranks with "
            f"sharding {sharding}, the FSDP equivalent of that ZeRO stage.")
    else:
        strategy.ltconform_note = None
    return strategy


def _hybrid_note(user_strategy: Any, sharding: str) -> str:
    """What a hybrid sharding (or the user's device_mesh) ran as on this world's nodes."""
    nodes, per_node = world_layout()
    mesh = (getattr(user_strategy, "kwargs", None) or {}).get("device_mesh")
    said = ""
    if mesh is not None:
        said = (f" The config's device_mesh={mesh!r} is not used here: Lightning's FSDPStrategy builds its mesh "
                f"with init_device_mesh('cuda', ...), which needs a GPU")
    if sharding not in HYBRID:
        return said + ("." if said else "")
    lead = f"{said}; " if said else " "
    if nodes > 1:
        return lead + (f"{sharding} ran as FULL_SHARD over the {nodes * per_node} ranks of the {nodes} nodes: the "
                       f"CPU tier does not run hybrid sharding across nodes (strategy-config judges your mesh "
                       f"against num_nodes x devices).")
    return lead + (f"{sharding} ran on a CPU device mesh of 1 x {per_node}: sharded within this one node of "
                   f"{per_node} ranks, with nothing to replicate across.")


def ddp_note(strategy_name: str, user_strategy: Any) -> str | None:
    """For a DDP item whose user's Trainer config names a sharded strategy: one sentence saying
    that this item ran DDP, and where the sharded tier runs. None otherwise."""
    if strategy_name != "ddp" or sharded_kind(user_strategy) is None:
        return None
    return (f"the Trainer config names {describe(user_strategy)}; this item runs the model under DDP on CPU gloo "
            f"ranks, and the [fsdp] items run your sharded settings (the CPU sharded tier).")


def deepspeed_installed() -> bool:
    """Whether the deepspeed package is installed (found, not imported)."""
    return importlib.util.find_spec("deepspeed") is not None


@contextlib.contextmanager
def deepspeed_stand_in():
    """While active, and only where the deepspeed package is not installed, constructing a
    Lightning ``DeepSpeedStrategy`` records its settings (``.config`` built the way Lightning
    builds it, ``.ltconform_stand_in = True``) instead of raising for the missing package.

    Such an object is for reading only: a Trainer cannot run it (nothing could: DeepSpeed is
    absent); the worlds replace it with the CPU sharded tier.
    """
    if deepspeed_installed():
        yield
        return
    patched = []
    for ns in ("lightning.pytorch", "pytorch_lightning"):
        mod = sys.modules.get(f"{ns}.strategies.deepspeed")
        cls = getattr(mod, "DeepSpeedStrategy", None) if mod is not None else None
        if cls is None or "__init__" not in cls.__dict__:
            continue
        original = cls.__dict__["__init__"]
        cls.__init__ = _recording_init(cls, original)
        patched.append((cls, original))
    try:
        yield
    finally:
        for cls, original in patched:
            cls.__init__ = original


def _recording_init(cls: type, original):
    signature = inspect.signature(original)
    default_params = set(inspect.signature(cls._create_default_config).parameters) - {"self", "zero_kwargs"}
    zero_keys = ("stage", "contiguous_gradients", "overlap_comm", "allgather_partitions", "reduce_scatter",
                 "allgather_bucket_size", "reduce_bucket_size", "sub_group_size")

    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        params = dict(bound.arguments)
        params.pop("self", None)
        # The parallel-strategy base only stores these; it needs nothing from deepspeed.
        base_init = cls.__mro__[1].__init__
        base_init(self, accelerator=params.get("accelerator"), parallel_devices=params.get("parallel_devices"),
                  cluster_environment=params.get("cluster_environment"),
                  precision_plugin=params.get("precision_plugin"),
                  process_group_backend=params.get("process_group_backend"))
        self._timeout = params.get("timeout")
        self.ltconform_stand_in = True
        config = self._load_config(params.get("config"))
        if config is None:
            config = self._create_default_config(**{k: params[k] for k in params
                                                    if k in default_params or k in zero_keys})
        self.config = config

    return __init__


# -- DeepSpeed on CPU gloo ranks ------------------------------------------------------------------
# Lightning 2.6.6 refuses DeepSpeed without CUDA, but DeepSpeed ZeRO 2 and 3 train on CPU gloo
# ranks with four overrides (docs: shared recipe "deepspeed-on-cpu-gloo"): no CUDA check, no
# device-index validation, a root device with an index, and the gloo backend. The rank's
# environment carries DS_ACCELERATOR=cpu (tiers.base.CPU_RANK_ENV), set before deepspeed is imported.

# Optimizer types DeepSpeed builds from its config; on CPU only its torch path runs. Its other
# types are torch.optim names it builds as such, Adagrad (torch's without offload), or those below,
# which need compiled kernels.
_DS_ADAM_TYPES = {"adam": "Adam", "adamw": "AdamW"}
_DS_COMPILED_TYPES = ("lamb", "onebitadam", "zerooneadam", "onebitlamb", "lion")
_DS_OFFLOAD_KEYS = ("offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_params")
_DS_HALF_KEYS = ("fp16", "bf16", "amp")


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and section.get("enabled", True) not in (False, "false")


def cpu_deepspeed_config(config: Any) -> tuple[dict, list[str]]:
    """A copy of a DeepSpeed config dict that CPU gloo ranks can run, and what was substituted.

    The substitutions keep the same collectives: DeepSpeed's fused or CPU-Adam optimizers become
    its ``torch_adam`` path (torch's Adam/AdamW, same hyper-parameters), its optimizers that need
    compiled kernels (Lamb, Lion, the 1-bit ones) become torch AdamW with their lr, betas, eps and
    weight decay (torch.optim names and Adagrad run as they are), CPU/NVMe offload is dropped (the partitioned
    state stays in rank memory) and fp16/bf16 sections are dropped (fp32). Returns
    ``(config, ["what -> what instead", ...])``; a non-dict config is returned unchanged.
    """
    import copy

    if not isinstance(config, dict):
        return config, []
    config = copy.deepcopy(config)
    done: list[str] = []
    opt = config.get("optimizer")
    if isinstance(opt, dict):
        kind = str(opt.get("type", ""))
        params = dict(opt.get("params") or {})
        if kind.lower() in _DS_ADAM_TYPES:
            if not params.get("torch_adam"):
                params["torch_adam"] = True
                # DeepSpeed's "Adam" decouples weight decay (AdamW) unless adam_w_mode is false.
                torch_cls = "AdamW" if kind.lower() == "adamw" or params.get("adam_w_mode", True) else "Adam"
                done.append(f"the config's {kind} optimizer runs as torch.optim.{torch_cls} "
                            f"(DeepSpeed's FusedAdam/CPUAdam need compiled ops)")
            opt["params"] = params
        elif kind.lower() in _DS_COMPILED_TYPES or not kind:
            kept = {k: params[k] for k in ("lr", "weight_decay", "betas", "eps") if k in params}
            config["optimizer"] = {"type": "AdamW", "params": {**kept, "torch_adam": True}}
            done.append(f"the config's {kind or 'untyped'} optimizer runs as torch.optim.AdamW, the nearest "
                        f"torch optimizer, with its lr, betas, eps and weight_decay (DeepSpeed's own "
                        f"optimizers need compiled ops)")
    zero = config.get("zero_optimization")
    if isinstance(zero, dict):
        dropped = [k for k in _DS_OFFLOAD_KEYS if k in zero and (not isinstance(zero[k], dict)
                                                                  or zero[k].get("device", "cpu") != "none")]
        for key in _DS_OFFLOAD_KEYS:
            zero.pop(key, None)
        if dropped:
            done.append(f"{' and '.join(dropped)} dropped (no offload: the partitioned state stays in rank memory)")
    half = [k for k in _DS_HALF_KEYS if _enabled(config.get(k))]
    for key in _DS_HALF_KEYS:
        config.pop(key, None)
    if half:
        done.append(f"{'/'.join(half)} dropped (fp32)")
    return config, done


def _reset_deepspeed_globals() -> None:
    """Forget the process groups DeepSpeed cached in an earlier job of this rank process: each
    job has a fresh default process group, and a cached group of the last one is destroyed."""
    ds_comm = importlib.import_module("deepspeed.comm.comm")
    groups = importlib.import_module("deepspeed.utils.groups")

    ds_comm.cdb = None
    for name, value in list(vars(groups).items()):
        if name in ("mpu", "mesh_device") or (name.startswith("_") and name.isupper() and not isinstance(value, str)):
            setattr(groups, name, {} if isinstance(value, dict) else None)


def _cpu_deepspeed_subclass(base: type) -> type:
    import torch
    from lightning.fabric.utilities.seed import reset_seed

    class CPUDeepSpeedStrategy(base):
        """DeepSpeedStrategy on CPU gloo ranks (the four overrides of the recipe)."""

        ltconform_deepspeed_cpu = True  # not ltconform_cpu_tier: that one marks the CPU FSDP tier

        @property
        def root_device(self):
            # DeepSpeed reads the device rank from root_device.index (None for plain "cpu").
            return torch.device("cpu", self.local_rank)

        def setup_environment(self):
            # DeepSpeedStrategy's own raises for a non-CUDA accelerator; DDP's sets up the ranks.
            super(base, self).setup_environment()

        def setup_distributed(self):
            # As DeepSpeedStrategy's, minus the CUDA device-index validation.
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        def _init_deepspeed_distributed(self):
            ds_torch = importlib.import_module("deepspeed.comm.torch")  # deepspeed.comm.torch is torch itself

            _reset_deepspeed_globals()
            # The shared-memory all-reduce kernel would be compiled with the host's compiler on
            # every fresh rank (tens of seconds); the gloo collectives are what the contracts watch.
            build = ds_torch.build_shm_op
            ds_torch.build_shm_op = lambda: None
            try:
                super()._init_deepspeed_distributed()
            finally:
                ds_torch.build_shm_op = build

        def _get_process_group_backend(self):
            return "gloo"

    CPUDeepSpeedStrategy.__qualname__ = f"CPU{base.__qualname__}"
    return CPUDeepSpeedStrategy


def cpu_deepspeed_strategy(ns: Any, user_strategy: Any = None, timeout_s: float | None = None) -> Any:
    """A real DeepSpeedStrategy of namespace ``ns`` that trains on CPU gloo ranks.

    Keeps the user's settings when ``user_strategy`` is a DeepSpeedStrategy (their ZeRO stage and
    config dict, their subclass' overrides); a registered name ('deepspeed_stage_3_offload') gets
    its registered settings; anything else Lightning's default (``strategy="deepspeed"``: ZeRO
    stage 2). What CPU cannot run is substituted (:func:`cpu_deepspeed_config`). Needs the
    deepspeed package. ``timeout_s`` bounds every collective (seconds). The returned object
    carries ``ltconform_note`` (one sentence, or None when the config names no DeepSpeed and
    nothing was substituted) and ``ltconform_fp32`` (the Trainer must run fp32).
    """
    import datetime

    strategies = importlib.import_module(f"{ns.__name__}.strategies")
    base = strategies.DeepSpeedStrategy
    kind = sharded_kind(user_strategy)
    if kind == "deepspeed" and isinstance(user_strategy, base):
        cls = _cpu_deepspeed_subclass(type(user_strategy))
        strategy = cls.__new__(cls)
        strategy.__dict__.update(user_strategy.__dict__)
    else:
        init: dict = {}
        if kind == "deepspeed" and isinstance(user_strategy, str):
            registry = strategies.StrategyRegistry
            init = dict((registry[user_strategy] if user_strategy in registry else {}).get("init_params") or {})
        strategy = _cpu_deepspeed_subclass(base)(**init)
    strategy.config, substituted = cpu_deepspeed_config(strategy.config)
    if timeout_s is not None:
        strategy._timeout = datetime.timedelta(seconds=timeout_s)
    strategy.ltconform_fp32 = True
    strategy.ltconform_note = _deepspeed_note(user_strategy, kind, strategy, substituted)
    return strategy


def _deepspeed_note(user_strategy: Any, kind: str | None, strategy: Any, substituted: list[str]) -> str | None:
    stage = (strategy.config.get("zero_optimization") or {}).get("stage") if isinstance(strategy.config, dict) else None
    swapped = f"; substituted on CPU: {'; '.join(substituted)}" if substituted else ""
    if kind == "deepspeed":
        return (f"the Trainer config names {describe(user_strategy)}; this item ran real DeepSpeed ZeRO stage "
                f"{stage} on CPU gloo ranks (the CPU deepspeed tier) with your config{swapped}.")
    return f"this item ran Lightning's default DeepSpeed (ZeRO stage {stage}) on CPU gloo ranks{swapped}." \
        if substituted else None


def precision_note(strategy: Any, precision: Any) -> str | None:
    """For a strategy that must run fp32 on CPU (``ltconform_fp32``) and a Trainer ``precision``
    that is not fp32: the sentence saying so, else None."""
    if not getattr(strategy, "ltconform_fp32", False) or precision in (None, 32, "32", "32-true"):
        return None
    return f"Trainer(precision={precision!r}) ran as precision='32-true' (DeepSpeed half precision needs a GPU)."


def configured_for(strategy_name: str, user_strategy: Any) -> bool:
    """Whether the user's Trainer config asks for what an item of ``strategy_name`` runs: any
    sharded strategy for an 'fsdp' item (it runs DeepSpeed configs too), DeepSpeed for a
    'deepspeed' item; always for 'ddp'."""
    kind = sharded_kind(user_strategy)
    if strategy_name == "fsdp":
        return kind is not None
    if strategy_name == "deepspeed":
        return kind == "deepspeed"
    return True


# -- what DeepSpeed's own config validation says -------------------------------------------------

class _WorldOnly:
    """Stands in for deepspeed.comm's backend while DeepSpeed's config class reads the rank and
    world size: it answers from torch.distributed (or the given size) and communicates nothing."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def is_initialized(self) -> bool:
        return True

    def get_rank(self, group=None) -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0

    def get_world_size(self, group=None) -> int:
        return self.world_size


def deepspeed_config_error(config: dict, world_size: int) -> dict | None:
    """Validate ``config`` (a complete DeepSpeed config dict, as the engine receives it) with
    DeepSpeed's own config class for a world of ``world_size`` ranks; needs deepspeed.

    Returns None when DeepSpeed accepts it, else ``{"type": exception type name, "message": its
    message on one line, "keys": [config keys it names], "detail": "field: what (got value)" per
    error, or ""}`` (a pydantic validation error names the fields it rejected). Raises nothing for a
    rejected config.
    """
    ds_config = importlib.import_module("deepspeed.runtime.config")
    ds_comm = importlib.import_module("deepspeed.comm.comm")
    saved = ds_comm.cdb
    ds_comm.cdb = _WorldOnly(world_size)
    try:
        ds_config.DeepSpeedConfig(dict(config))
        return None
    except Exception as exc:
        keys, details = _pydantic_errors(exc)
        message = " ".join(str(exc).split())
        message = message.split(" For further information visit ")[0]  # pydantic's link per error
        return {"type": type(exc).__name__, "message": message, "keys": keys, "detail": "; ".join(details)}
    finally:
        ds_comm.cdb = saved


# Where DeepSpeed's config class keeps what it read from a section of the config dict.
_DS_SECTIONS = {"zero_optimization": "zero_config", "fp16": "float16_config", "bf16": "bfloat16_config",
                "optimizer": "optimizer_params", "scheduler": "scheduler_params"}
_UNREAD = object()


def deepspeed_auto_effects(config: dict, paths: list[str], world_size: int, fill: dict | None = None) -> dict:
    """What DeepSpeed's own config class makes of each "auto" value at ``paths`` (dotted paths into
    ``config``), one at a time with every other "auto" key left out and the top-level keys ``fill``
    set where absent (what Lightning sets when the config has none: the micro-batch size, the
    accumulation); needs deepspeed. Per path: ``{"effect": "refused", "error": "TypeError: ..."}`` (the config
    is rejected), ``"kept"`` (the string "auto" is what DeepSpeed holds), ``"default"`` (replaced by
    what DeepSpeed holds without the key: ``value``), ``"value"`` (another ``value``) or ``"unread"``
    (no field of DeepSpeed's config holds it)."""
    import copy

    def without(cfg: dict, path: str) -> dict:
        out = copy.deepcopy(cfg)
        *head, last = path.split(".")
        node = out
        for key in head:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
        for key, value in (fill or {}).items():
            out.setdefault(key, value)
        return out

    effects = {}
    for path in paths:
        only = without(config, "")
        for other in paths:
            if other != path:
                only = without(only, other)
        parsed, error = _parsed(only, world_size)
        if parsed is None:
            effects[path] = {"effect": "refused", "error": error}
            continue
        value = _parsed_value(parsed, path)
        default = _parsed_value(_parsed(without(only, path), world_size)[0], path)
        if value is _UNREAD:
            effects[path] = {"effect": "unread"}
        elif isinstance(value, str) and value.strip().lower() == "auto":
            effects[path] = {"effect": "kept"}
        else:
            effects[path] = {"effect": "default" if value == default else "value", "value": repr(value)}
    return effects


def _parsed(config: dict, world_size: int):
    """(DeepSpeed's config object for ``config``, None) or (None, "Type: message") when it refuses it."""
    ds_config = importlib.import_module("deepspeed.runtime.config")
    ds_comm = importlib.import_module("deepspeed.comm.comm")
    saved = ds_comm.cdb
    ds_comm.cdb = _WorldOnly(world_size)
    try:
        return ds_config.DeepSpeedConfig(dict(config)), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    finally:
        ds_comm.cdb = saved


def _parsed_value(parsed, path: str):
    """The value DeepSpeed's config object ``parsed`` holds for the dict path ``path``."""
    if parsed is None:
        return _UNREAD
    head, _, rest = path.partition(".")
    if not rest:
        return getattr(parsed, head, _UNREAD)
    section = getattr(parsed, _DS_SECTIONS.get(head, head), None)
    if isinstance(section, dict):  # optimizer/scheduler params: {"params": {...}} in the dict
        return section.get(rest.removeprefix("params."), _UNREAD)
    fields = getattr(type(section), "model_fields", {})
    key = rest.split(".")[0]
    for name, field in fields.items():
        if key in (name, getattr(field, "alias", None)):
            return getattr(section, name, _UNREAD)
    return _UNREAD


def _pydantic_errors(exc: Exception) -> tuple[list[str], list[str]]:
    """The fields a pydantic validation error names and one ``field: what (got value)`` per error;
    empty for any other exception."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return [], []
    try:
        found = [e for e in errors() if e.get("loc")]
        return ([str(e["loc"][-1]) for e in found],
                [f"{'.'.join(map(str, e['loc']))}: {e.get('msg')} (got {e.get('input')!r})" for e in found])
    except Exception:  # not pydantic's shape
        return [], []


# -- optimizers a CPU rank cannot run ---------------------------------------------------------------
# DeepSpeed's fused and CPU optimizers need kernels compiled on the rank (minutes, or a hang while
# compiling); the CPU tiers construct the nearest torch optimizer instead, with the same parameter
# groups and hyper-parameters. (module, class) -> (torch class, the arguments it keeps).
_ADAM_ARGS = ("lr", "betas", "eps", "weight_decay")
_CPU_SUBSTITUTES = {
    ("deepspeed.ops.adam", "FusedAdam"): ("Adam", _ADAM_ARGS + ("amsgrad",)),
    ("deepspeed.ops.adam", "DeepSpeedCPUAdam"): ("Adam", _ADAM_ARGS + ("amsgrad",)),
    ("deepspeed.ops.lamb", "FusedLamb"): ("AdamW", _ADAM_ARGS),
    ("deepspeed.ops.adagrad", "DeepSpeedCPUAdagrad"): ("Adagrad", ("lr", "eps", "weight_decay")),
    ("deepspeed.ops.lion", "FusedLion"): ("AdamW", ("lr", "betas", "weight_decay")),
    ("deepspeed.ops.lion", "DeepSpeedCPULion"): ("AdamW", ("lr", "betas", "weight_decay")),
}


def _substitute_new(cls: type, torch_name: str, kept: tuple, report):
    import torch

    signature = inspect.signature(cls.__init__)

    def __new__(klass, *args, **kwargs):
        bound = signature.bind(None, *args, **kwargs)
        given = set(bound.arguments)
        bound.apply_defaults()  # DeepSpeed's defaults, not torch's (AdamW's weight decay differs)
        values = dict(bound.arguments)
        params = values.pop("params", None) or values.pop("model_params", None)
        params = list(params) if params is not None and not isinstance(params, (list, tuple)) else params
        groups = sum(1 for p in params or () if isinstance(p, dict))
        name = torch_name
        # FusedAdam(adam_w_mode=True) and DeepSpeedCPUAdam(adamw_mode=True) decouple weight decay.
        if name == "Adam" and (values.get("adam_w_mode") or values.get("adamw_mode")):
            name = "AdamW"
        torch_cls = getattr(torch.optim, name)
        chosen = {k: values[k] for k in kept if k in values}
        shown = ", ".join(f"{k}={values[k]!r}" for k in kept if k in given) or "its default hyper-parameters"
        same = f"the same {groups} parameter groups (each with its own settings) and " if groups else "the same " \
            "parameters and "
        report(f"{klass.__name__} from configure_optimizers ran as torch.optim.{name} with {same}{shown} "
               f"(DeepSpeed's {klass.__name__} needs kernels compiled on the rank, which the CPU tier does not "
               f"build)")
        return torch_cls(params, **chosen)

    return __new__


@contextlib.contextmanager
def cpu_optimizers(report):
    """While active, constructing one of DeepSpeed's compiled optimizers (FusedAdam,
    DeepSpeedCPUAdam, FusedLamb, DeepSpeedCPUAdagrad, FusedLion, DeepSpeedCPULion) returns the
    nearest torch optimizer with the same parameter groups and hyper-parameters, and calls
    ``report(sentence)`` once per substitution. Patches the classes themselves, so a name the
    user imported before is covered; undone on exit. Does nothing where deepspeed has not been
    imported (by the user's module or the DeepSpeed strategy)."""
    patched = []
    if "deepspeed" in sys.modules:  # importing it here would cost every rank 2 s for nothing
        for (module_name, name), (torch_name, kept) in _CPU_SUBSTITUTES.items():
            try:
                cls = getattr(importlib.import_module(module_name), name)
            except (ImportError, AttributeError):
                continue
            patched.append((cls, cls.__dict__.get("__new__")))
            cls.__new__ = _substitute_new(cls, torch_name, kept, report)
    try:
        yield
    finally:
        for cls, original in patched:
            if original is None:
                del cls.__new__
            else:
                cls.__new__ = original
