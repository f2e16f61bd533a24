"""strategy-config, rank side: what its probe observes on every rank (the package's docstring says
what the verdict makes of it).
"""

from __future__ import annotations

import os

from ...events import Recorded, declare
from ...runs import Probe


class DsAutoEvent(Recorded):
    """The traced fit runs a DeepSpeed config that holds "auto" at ``paths`` (dotted paths)."""

    paths: list


DS_AUTO = declare("ds_auto", DsAutoEvent)

NUMERIC_ZERO_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                     "stage3_param_persistence_threshold", "stage3_max_live_parameters",
                     "stage3_max_reuse_distance", "sub_group_size")

NUMERIC_TOP_KEYS = ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps")

# Keys of DeepSpeed's "zero_optimization" section (DeepSpeedZeroConfig's fields and aliases). None is
# a top-level key too, and DeepSpeed ignores top-level keys it does not know without a word.
ZERO_SECTION_KEYS = ("stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param",
                     "cpu_offload_use_pin_memory", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
                     "allgather_partitions", "allgather_bucket_size", "overlap_comm", "sub_group_size",
                     "round_robin_gradients", "elastic_checkpoint", "load_from_fp32_weights",
                     "ignore_unused_parameters",
                     "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients",
                     "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                     "stage3_model_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                     "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save")

# What DeepSpeed uses for a ZeRO key the section leaves out, where that is the point of the finding.
ZERO_DEFAULTS = {"stage": "0 (ZeRO disabled)", "offload_optimizer": "none (no optimizer offload)",
                 "offload_param": "none (no parameter offload)", "cpu_offload": "false (no offload)",
                 "reduce_bucket_size": "500000000", "allgather_bucket_size": "500000000"}

def _mro_names(obj) -> list[str]:
    return [k.__name__ for k in type(obj).__mro__]

def _policy_classes(policy) -> list[type] | None:
    """The module classes an FSDP wrap/checkpoint policy selects (None: not a class-based policy)."""
    import functools

    if policy is None:
        return None
    if isinstance(policy, (set, frozenset, list, tuple)):
        return [c for c in policy if isinstance(c, type)]
    classes = getattr(policy, "_module_classes", None)
    if classes is not None:
        return list(classes)
    if isinstance(policy, functools.partial):
        for key in ("transformer_layer_cls", "module_classes"):
            if key in policy.keywords:
                return list(policy.keywords[key])
    closure = getattr(policy, "__closure__", None) or ()
    for cell in closure:
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, tuple) and value and all(isinstance(c, type) for c in value):
            return list(value)
    return None

def _model_modules(model) -> tuple[list, str | None]:
    """Every module of the model after configure_model (built on the meta device)."""
    import torch

    note = None
    method = getattr(type(model), "configure_model", None)
    base = None
    for klass in type(model).__mro__:
        if klass.__name__ == "LightningModule":
            base = getattr(klass, "configure_model", None)
    if method is not None and method is not base:
        try:
            with torch.device("meta"):
                model.configure_model()
        except Exception as exc:
            note = f"configure_model could not run on the meta device ({type(exc).__name__}: {exc})"
    return list(model.modules()), note

def _config_line(module_file: str | None, needles: list[str]) -> dict | None:
    """The first code line (not a docstring or comment) of the user's config module that mentions
    one of ``needles``, tried in order, with the function it sits in."""
    import ast

    if not module_file:
        return None
    try:
        with open(module_file, encoding="utf-8") as fh:
            source = fh.read()
        tree = ast.parse(source)
    except (OSError, SyntaxError):
        return None
    lines = source.splitlines()
    skip: set[int] = set()
    funcs: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) > 30:
            skip.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))  # docstrings and prose
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            funcs.append((node.lineno, node.end_lineno or node.lineno, node.name))
    for needle in needles:
        for i, line in enumerate(lines, 1):
            if i in skip or line.lstrip().startswith("#"):
                continue
            if needle in line.split("#", 1)[0]:
                inside = [f for f in funcs if f[0] <= i <= f[1]]
                func = max(inside)[2] if inside else "<module>"
                return {"file": module_file, "line": i, "func": func}
    return None

def _precision(user: dict) -> str:
    value = str(user.get("precision", "32-true"))
    return {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true"}.get(value, value)

def _fsdp_facts(strategy, model, user: dict, file: str | None) -> list[dict]:
    import torch

    findings = []
    modules, note = _model_modules(model)
    counts: dict[type, int] = {}
    for m in modules:
        counts[type(m)] = counts.get(type(m), 0) + 1
    repeated = sorted(((c, n) for c, n in counts.items() if n >= 2 and not c.__module__.startswith("torch.")),
                      key=lambda cn: -cn[1])
    hint = (f"its repeated layer class is {repeated[0][0].__qualname__} ({repeated[0][1]} instances)"
            if repeated else "it repeats no layer class of its own")
    policies = {"auto_wrap_policy": (getattr(strategy, "kwargs", None) or {}).get("auto_wrap_policy")}
    ckpt = getattr(strategy, "_activation_checkpointing_kwargs", None) or {}
    policies["activation_checkpointing_policy"] = ckpt.get("auto_wrap_policy") or ckpt.get("check_fn")
    absent: dict[str, list[str]] = {}
    for arg, policy in policies.items():
        classes = _policy_classes(policy)
        for cls in classes or []:
            found = sum(1 for m in modules if isinstance(m, cls))
            if found == 0:
                absent.setdefault(cls.__qualname__, []).append(arg)
    for name, args in absent.items():
        findings.append({
            "kind": "fsdp_policy_absent", "class": name, "args": args, "hint": hint, "note": note,
            "model": type(model).__qualname__,
            "site": _config_line(file, [name, "auto_wrap_policy", "FSDPStrategy("]),
        })
    findings += _mesh_facts(strategy, user, file)
    mp = getattr(strategy, "mixed_precision", None)
    if mp is not None:
        from torch.distributed.fsdp import MixedPrecision

        if not isinstance(mp, MixedPrecision):
            findings.append({"kind": "fsdp_mixed_precision", "type": type(mp).__name__, "value": repr(mp)[:60],
                             "precision": _precision(user),
                             "site": _config_line(file, ["mixed_precision", "FSDPStrategy("])})
    del torch
    return findings

def _count(value) -> int | None:
    """num_nodes / devices as a number (a list of devices counts its entries); None for 'auto'."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    if isinstance(value, (list, tuple)):
        return len(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip()) or None
    return None


def _mesh_facts(strategy, user: dict, file: str | None) -> list[dict]:
    """A hybrid sharding or a device_mesh against the production world: the mesh's product is
    num_nodes x devices, and each shard group (the mesh's last dimension) lies inside one node.
    Judged from the config: Lightning builds the mesh on 'cuda', so a CPU run cannot build the
    user's own (the nodes tier runs the sharding on a CPU mesh of its own layout instead)."""
    sharding = getattr(getattr(strategy, "sharding_strategy", None), "name", "") or ""
    mesh = (getattr(strategy, "kwargs", None) or {}).get("device_mesh")
    shape = tuple(mesh) if isinstance(mesh, tuple) else tuple(getattr(mesh, "shape", ()) or ())
    if "HYBRID" not in sharding and not shape:
        return []
    nodes, devices = _count(user.get("num_nodes", 1)), _count(user.get("devices"))
    site = _config_line(file, ["device_mesh", "sharding_strategy", "FSDPStrategy("])
    base = {"sharding": sharding or "FULL_SHARD", "mesh": list(shape), "num_nodes": nodes, "devices": devices,
            "site": site}
    if len(shape) == 2 and nodes and devices and shape[0] * shape[1] != nodes * devices:
        return [{"kind": "fsdp_mesh_size", **base}]
    if len(shape) == 2 and devices and shape[1] > devices:
        return [{"kind": "fsdp_mesh_across_nodes", **base}]
    if "HYBRID" in sharding and (shape[1:] == (1,) or (not shape and devices == 1 and (nodes or 1) > 1)):
        return [{"kind": "fsdp_hybrid_one_device", **base}]
    if "HYBRID" in sharding and nodes in (None, 1) and not shape:
        return [{"kind": "fsdp_hybrid_one_node", **base}]
    return []


def _walk(config, prefix=""):
    if isinstance(config, dict):
        for key, value in config.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            yield path, value
            yield from _walk(value, path)

def _deepspeed_facts(strategy, model, user: dict, file: str | None) -> list[dict]:
    """Findings on a DeepSpeed config dict, in this order: "auto" values, non-numeric sizes, two
    optimizer owners, accumulation, precision sections, NVMe offload paths."""
    config = getattr(strategy, "config", None)
    if not isinstance(config, dict):
        return []
    zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
    return (_ds_auto(config, file) + _ds_non_numeric(config, zero, file) + _ds_optimizer_owner(config, model, file)
            + _ds_accumulation(config, user, file) + _ds_precision(config, user, file)
            + _ds_zero_key_outside(config, zero, file) + _ds_offload(zero, file))

def _ds_zero_key_outside(config: dict, zero: dict, file: str | None) -> list[dict]:
    """ZeRO keys written at the top level of the config, where DeepSpeed never reads them, with
    what the "zero_optimization" section in effect holds for each."""
    findings = []
    for key in config:
        if key not in ZERO_SECTION_KEYS:
            continue
        if key in zero:
            in_effect = f"its own {key}={zero[key]!r}, which is the one used"
        else:
            in_effect = f"no {key}, so DeepSpeed uses its default: {ZERO_DEFAULTS.get(key, 'the default value')}"
        findings.append({"kind": "ds_zero_key_outside", "key": key, "value": repr(config[key])[:80],
                         "stage": zero.get("stage", 0), "in_effect": in_effect,
                         "site": _config_line(file, [f'"{key}"', f"'{key}'", f"{key}="])})
    return findings

def _is_auto(value) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"

def _ds_auto(config: dict, file: str | None) -> list[dict]:
    autos = [p for p, v in _walk(config) if _is_auto(v)]
    if not autos:
        return []
    return [{"kind": "ds_auto", "paths": autos, "site": _config_line(file, ['"auto"', "'auto'"])}]

# What DeepSpeed does with a value its config reader keeps as the string "auto", where its source
# shows it: (module, function, the source text that uses it, what that does).
_AUTO_USES = {"gradient_clipping": ("deepspeed.runtime.engine", "DeepSpeedEngine._take_model_step",
                                    "self.gradient_clipping() > 0.0",
                                    "its engine compares it with 0.0 before every optimizer step "
                                    "(`gradient_clipping() > 0.0`): a TypeError at the first step")}


def _auto_effects(findings: list[dict], strategy, loaded, user: dict, world_size: int) -> None:
    """Add to the "auto" finding what DeepSpeed's own config reader makes of each "auto" value
    (sharded.deepspeed_auto_effects), and for one it keeps as a string, what its source does with
    it; nothing where deepspeed is not importable."""
    import importlib
    import importlib.util
    import inspect

    from ... import sharded

    auto = next((f for f in findings if f["kind"] == "ds_auto"), None)
    if auto is None or importlib.util.find_spec("deepspeed") is None:
        return
    fill = {"gradient_accumulation_steps": int(user.get("accumulate_grad_batches", 1) or 1),
            "train_micro_batch_size_per_gpu": _loader_batch_size(loaded)}
    try:
        effects = sharded.deepspeed_auto_effects(strategy.config, auto["paths"], world_size, fill)
    except Exception as exc:  # a DeepSpeed build that cannot read configs here: say nothing measured
        auto["effects_error"] = f"{type(exc).__name__}: {exc}"[:200]
        return
    for path, effect in effects.items():
        use = _AUTO_USES.get(path)
        if effect["effect"] == "kept" and use is not None:
            module, qualname, text, words = use
            try:
                owner = importlib.import_module(module)
                for part in qualname.split("."):
                    owner = getattr(owner, part)
                if text in inspect.getsource(owner):
                    effect["use"] = words
            except Exception:
                pass  # another DeepSpeed version: its use is not stated
    auto["effects"] = effects


def _ds_non_numeric(config: dict, zero: dict, file: str | None) -> list[dict]:
    """Bucket and batch sizes given as strings ("auto" is reported on its own)."""
    bad = []
    for key, where in [(k, zero) for k in NUMERIC_ZERO_KEYS] + [(k, config) for k in NUMERIC_TOP_KEYS]:
        if key in where:
            value = where[key]
            if (isinstance(value, bool) or not isinstance(value, (int, float))) and not _is_auto(value):
                prefix = "zero_optimization." if where is zero else ""
                bad.append(f"{prefix}{key}={value!r}")
    if not bad:
        return []
    return [{"kind": "ds_non_numeric", "items": bad,
             "site": _config_line(file, [b.split("=")[0].split(".")[-1] for b in bad])}]

def _ds_optimizer_owner(config: dict, model, file: str | None) -> list[dict]:
    if "optimizer" not in config and "scheduler" not in config:
        return []
    owner = _configure_optimizers_returns(model)
    if not owner:
        return []
    return [{"kind": "ds_optimizer_owner", "keys": [k for k in ("optimizer", "scheduler") if k in config],
             "config_optimizer": str((config.get("optimizer") or {}).get("type", "?")),
             "module_optimizer": owner, "site": _config_line(file, ['"optimizer"', "'optimizer'"])}]

def _ds_accumulation(config: dict, user: dict, file: str | None) -> list[dict]:
    if "gradient_accumulation_steps" not in config:
        return []
    return [{"kind": "ds_accumulation", "config": config["gradient_accumulation_steps"],
             "trainer": user.get("accumulate_grad_batches", 1),
             "site": _config_line(file, ["gradient_accumulation_steps"])}]

def _ds_precision(config: dict, user: dict, file: str | None) -> list[dict]:
    """fp16/bf16 sections that enable (or disable) a precision the Trainer does not (or does) use."""
    findings = []
    precision = _precision(user)
    for key, want in (("fp16", ("16-mixed", "16-true")), ("bf16", ("bf16-mixed", "bf16-true"))):
        section = config.get(key)
        # "enabled": "auto" is no decision of the user's (the "auto" finding says what DeepSpeed reads)
        enabled = isinstance(section, dict) and section.get("enabled") not in (False, "false", None) \
            and section.get("enabled", True) not in (False,) and not _is_auto(section.get("enabled"))
        if enabled and precision not in want:
            findings.append({"kind": "ds_precision", "key": key, "precision": precision,
                             "site": _config_line(file, [f'"{key}"', f"'{key}'"])})
        if isinstance(section, dict) and section.get("enabled") is False and precision in want:
            findings.append({"kind": "ds_precision_off", "key": key, "precision": precision,
                             "site": _config_line(file, [f'"{key}"', f"'{key}'"])})
    return findings

def _ds_offload(zero: dict, file: str | None) -> list[dict]:
    """NVMe offload sections whose nvme_path is missing, absent on this node or not writable."""
    findings = []
    for section in ("offload_optimizer", "offload_param"):
        off = zero.get(section) if isinstance(zero.get(section), dict) else None
        if off and str(off.get("device", "")).lower() == "nvme":
            path = off.get("nvme_path")
            problem = None
            if not path:
                problem = "no nvme_path given"
            elif not os.path.isdir(str(path)):
                problem = "does not exist"
            elif not os.access(str(path), os.W_OK):
                problem = "is not writable"
            if problem:
                findings.append({"kind": "ds_offload_path", "section": section, "path": path, "problem": problem,
                                 "site": _config_line(file, ["nvme_path", "nvme", "DeepSpeedStrategy("])})
    return findings

def _configure_optimizers_returns(model) -> str | None:
    """The optimizer class configure_optimizers returns ('?' when it cannot be called here)."""
    method = getattr(type(model), "configure_optimizers", None)
    base = None
    for klass in type(model).__mro__:
        if klass.__name__ == "LightningModule":
            base = getattr(klass, "configure_optimizers", None)
    if method is None or method is base:
        return None
    try:
        out = model.configure_optimizers()
    except Exception:
        return "?"
    if out is None:
        return None
    import torch

    def find(obj):
        if isinstance(obj, torch.optim.Optimizer):
            return type(obj).__name__
        if isinstance(obj, dict):
            return find(obj.get("optimizer"))
        if isinstance(obj, (list, tuple)):
            for item in obj:
                got = find(item)
                if got:
                    return got
        return None

    return find(out) or type(out).__name__

def _timeout_facts(strategy, user: dict, ns, file: str | None) -> list[dict]:
    value = os.environ.get("NCCL_TIMEOUT")
    if value is None:
        return []
    from torch.distributed.constants import default_pg_timeout as default

    timeout = getattr(strategy, "_timeout", None) if not isinstance(strategy, str) and strategy is not None else None
    explicit = timeout is not None and timeout != default
    return [{"kind": "nccl_timeout", "value": value, "explicit": explicit,
             "timeout_s": timeout.total_seconds() if explicit else None,
             "strategy": type(strategy).__name__ if strategy is not None and not isinstance(strategy, str)
             else repr(strategy), "site": _config_line(file, ["NCCL_TIMEOUT"])}]

def _unknown_name(strategy, ns) -> list[dict]:
    if not isinstance(strategy, str) or strategy == "auto":
        return []
    import importlib

    registry = importlib.import_module(f"{ns.__name__}.strategies").StrategyRegistry
    known = set(registry.available_strategies()) | {"ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "fsdp",
                                                      "deepspeed", "single_device", "xla", "dp"}
    if strategy in known:
        return []
    import difflib

    return [{"kind": "unknown_name", "name": strategy,
             "close": difflib.get_close_matches(strategy, sorted(known), n=3)}]

def _loader_batch_size(loaded) -> int:
    """The train DataLoader's batch size, the micro-batch Lightning gives DeepSpeed when the
    config names none (1 when there is no loader or it has no batch sampler, as in Lightning)."""
    source = loaded.datamodule if loaded.datamodule is not None else loaded.model
    try:
        loader = source.train_dataloader()
    except Exception:  # no loader here: the fit reports that on its own
        return 1
    sampler = getattr(loader, "batch_sampler", None)
    return int(getattr(sampler, "batch_size", None) or 1)

def _ds_rejected(strategy, loaded, user: dict, file: str | None, world_size: int) -> list[dict]:
    """DeepSpeed's own validation of the config as the user wrote it, completed as Lightning
    completes it (accumulation from the Trainer, the micro-batch from the DataLoader when absent),
    for this world's size. Not the CPU tier's copy (sharded.cpu_deepspeed_config): that one drops
    the offload and half-precision sections, and with them a value DeepSpeed refuses on the GPUs
    (``"offload_optimizer": true``)."""
    import copy

    from ... import sharded

    config = getattr(strategy, "config", None)
    if not isinstance(config, dict):
        return []
    config = copy.deepcopy(config)
    config.setdefault("gradient_accumulation_steps", int(user.get("accumulate_grad_batches", 1) or 1))
    config.setdefault("train_micro_batch_size_per_gpu", _loader_batch_size(loaded))
    error = sharded.deepspeed_config_error(config, world_size)
    if error is None:
        return []
    keys = error["keys"] + [k for k in ("train_batch_size", "train_micro_batch_size_per_gpu")
                            if k in error["message"] and k in getattr(strategy, "config", {})]
    needles = [f'"{k}"' for k in keys] + [f"'{k}'" for k in keys] + [f"{k}=" for k in keys] + \
        ["DeepSpeedStrategy(", "config="]
    batch = {k: config.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                          "gradient_accumulation_steps")}
    return [{"kind": "ds_rejected", "type": error["type"], "message": error["message"], "keys": keys,
             "detail": error.get("detail", ""),
             "batch": batch, "world_size": world_size, "site": _config_line(file, needles)}]

class StrategyConfigProbe(Probe):
    def before_fit(self, objects, trainer, recorder) -> None:
        """In the traced fit (strategy-config observes it): the "auto" values of the user's DeepSpeed
        config, so that a fit DeepSpeed stops on one of them is this contract's to explain."""
        config = getattr(objects.user_kwargs.get("strategy"), "config", None)
        if recorder is not None and isinstance(config, dict):
            autos = [p for p, v in _walk(config) if _is_auto(v)]
            if autos:
                recorder.emit(DS_AUTO.new(paths=autos))

    def inspect(self, run) -> dict | None:
        """The user's strategy settings as findings (rank 0 only; None on other ranks). In a
        'deepspeed' run the config is also validated by DeepSpeed itself; a Trainer config that
        names no DeepSpeed gives ``{"not_deepspeed": <its strategy>}`` there."""
        from ...target import loading as target_loading

        if run.ctx.rank != 0:
            return None
        loaded = run.objects
        user = loaded.user_kwargs
        strategy = user.get("strategy")
        deepspeed_item = run.args.strategy == "deepspeed"
        if deepspeed_item and "DeepSpeedStrategy" not in _mro_names(strategy) and \
                not (isinstance(strategy, str) and strategy.lower().startswith("deepspeed")):
            return {"not_deepspeed": type(strategy).__name__ if strategy is not None and
                    not isinstance(strategy, str) else repr(strategy or "auto")}
        file = target_loading.trainer_file(run.target)
        names = _mro_names(strategy) if strategy is not None and not isinstance(strategy, str) else []
        findings: list[dict] = []
        if "FSDPStrategy" in names:
            findings += _fsdp_facts(strategy, loaded.model, user, file)
        if "DeepSpeedStrategy" in names:
            findings += _deepspeed_facts(strategy, loaded.model, user, file)
            _auto_effects(findings, strategy, loaded, user, run.ctx.world_size)
            if deepspeed_item:
                # After the findings on what the user wrote: where one explains the rejection (an
                # "auto" value), it is the cause and DeepSpeed's message the symptom.
                findings += _ds_rejected(strategy, loaded, user, file, run.ctx.world_size)
        findings += _timeout_facts(strategy, user, loaded.ns, file)
        findings += _unknown_name(strategy, loaded.ns)
        describe = type(strategy).__name__ if names else repr(strategy if strategy is not None else "auto")
        kind = "deepspeed" if "DeepSpeedStrategy" in names else "fsdp" if "FSDPStrategy" in names else None
        return {"strategy": describe, "kind": kind, "precision": _precision(user),
                "accumulate": user.get("accumulate_grad_batches", 1), "findings": findings,
                "stand_in": bool(getattr(strategy, "ltconform_stand_in", False))}
