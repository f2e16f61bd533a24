"""What a conformance run replaces of the user's Trainer kwargs, and the same in words.

The bounds (epochs, batches), the kwargs every conformance Trainer gets, and :func:`overridden`,
which says in words what :func:`~.harness.build_trainer_kwargs` (rank side) does, so the header can
say it without importing the harness. Pure: builds nothing, imports no torch or Lightning.
"""

from __future__ import annotations

from typing import Any

from .sharded import sharded_kind

# Bounds that keep a conformance run small whatever the production config says.
MAX_EPOCHS = 4
DEFAULT_EPOCHS = 2
LIMIT_BATCHES = 4


def launches_own_ranks(user_strategy: Any) -> bool:
    """Whether a DDP flavour has Lightning start the processes itself (spawn, fork, notebook):
    those run as plain DDP here, since the ranks are already started."""
    if isinstance(user_strategy, str):
        return user_strategy.lower().startswith(("ddp_spawn", "ddp_fork", "ddp_notebook"))
    return getattr(user_strategy, "_start_method", "popen") != "popen"


def on_gpus(accelerator: Any) -> str | None:
    """What a Trainer config's ``accelerator`` says of the ranks it is written for: 'gpu' (``"gpu"``,
    ``"cuda"``, a CUDA accelerator object), 'auto' (the default: Lightning picks CUDA on a machine
    with GPUs, as a GPU runner is), or None (``"cpu"``, ``"mps"``, ``"tpu"`` and the others)."""
    if accelerator is None or (isinstance(accelerator, str) and accelerator.lower() == "auto"):
        return "auto"
    if isinstance(accelerator, str):
        return "gpu" if accelerator.lower() in ("gpu", "cuda") else None
    return "gpu" if "cuda" in type(accelerator).__name__.lower() else None


def _strategy_replaced(user_strategy: Any) -> str | None:
    """What a [ddp] item runs instead of ``user_strategy`` (as the harness's ``_ddp_strategy`` decides), or
    None when it runs the user's own DDP. Sharded strategies are said in their items' notes."""
    if user_strategy is None or sharded_kind(user_strategy) is not None:
        return None
    if launches_own_ranks(user_strategy):
        return "DDP in started ranks"
    if isinstance(user_strategy, str):
        return None if user_strategy.lower() in ("auto", "ddp") or user_strategy.lower().startswith(
            "ddp_find_unused_parameters") else "DDP"
    is_ddp = any(k.__name__ == "DDPStrategy" for k in type(user_strategy).__mro__)
    return None if is_ddp else "DDP"


# What every conformance Trainer gets, whatever the user's kwargs say.
FORCED = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
STAGES = ("train", "val", "test", "predict")
_FP32 = (None, 32, "32", "32-true")


def epochs(value: Any) -> int:
    return DEFAULT_EPOCHS if value in (None, -1) else max(1, min(int(value), MAX_EPOCHS))


def steps(value: Any) -> Any:
    return value if value in (-1, None) else min(int(value), MAX_EPOCHS * LIMIT_BATCHES)


def limit(value: Any) -> Any:
    too_many = (isinstance(value, float) and value >= 1.0) or (isinstance(value, int) and value > LIMIT_BATCHES)
    return LIMIT_BATCHES if value is None or too_many else value


def is_progress_bar(callback: Any) -> bool:
    # Lightning refuses a ProgressBar callback next to enable_progress_bar=False.
    return any(k.__name__ == "ProgressBar" for k in type(callback).__mro__)


def is_checkpoint(callback: Any) -> bool:
    return any(k.__name__ == "Checkpoint" for k in type(callback).__mro__)


def callback_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else ([] if value is None else [value])


# Lightning callbacks that refuse a Trainer without a logger.
NEEDS_LOGGER = ("LearningRateMonitor", "DeviceStatsMonitor")


def needing_logger(callbacks: Any) -> list:
    """The callbacks among ``callbacks`` that need a logger (Lightning raises without one)."""
    return [c for c in callback_list(callbacks) if any(k.__name__ in NEEDS_LOGGER for k in type(c).__mro__)]


def val_interval(value: Any, limit_train: Any) -> Any:
    """``val_check_interval`` within the bounded epoch: Lightning refuses an interval in batches
    beyond the epoch's length, which the cap on training batches would make it."""
    if isinstance(value, int) and not isinstance(value, bool) and isinstance(limit_train, int) and value > limit_train:
        return limit_train
    return value


def _shown(value: Any) -> str:
    """A Trainer value as the header shows it: literals by repr, objects by class name."""
    if isinstance(value, (str, int, float, bool, type(None))):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    start = getattr(value, "_start_method", "popen")
    return f"{type(value).__name__}(start_method={start!r})" if start != "popen" else type(value).__name__


def overridden(user: dict, world_size: int, *, accelerator: str = "cpu", num_nodes: int | None = 1,
               strategies: tuple[str, ...] = ("ddp",)) -> list[str]:
    """The user's Trainer kwargs ``user`` that :func:`build_trainer_kwargs` and
    :func:`adapt_strategy` replace, as ``"key=value -> what runs"`` phrases in the order of
    ``user``, for a world of ``world_size`` ranks on ``num_nodes`` nodes (None: not known yet, so
    devices and num_nodes are not compared) with ``accelerator``; ``strategies`` are the item
    strategies that run ('deepspeed' runs fp32 on CPU). Pure: builds nothing, imports nothing."""
    out: list[str] = []
    for key, value in user.items():
        ran = _replacement(key, value, user, world_size, accelerator, num_nodes, strategies)
        if ran is not None:
            out.append(f"{key}={_shown(value)} -> {ran}")
    bars = [type(c).__name__ for c in callback_list(user.get("callbacks")) if is_progress_bar(c)]
    if bars:
        out.append(f"callbacks: {', '.join(bars)} removed (no progress bar)")
    needing = needing_logger(user.get("callbacks"))
    if needing and "logger" not in user:
        out.append(f"callbacks: {', '.join(type(c).__name__ for c in needing)} {_logger_given(needing)}")
    return out


def _logger_given(needing: list) -> str:
    verb = "needs" if len(needing) == 1 else "need"
    return f"{verb} a logger: each run gives it a CSVLogger that writes no file"


def _replacement(key: str, value: Any, user: dict, world_size: int, accelerator: str, num_nodes: int | None,
                 strategies: tuple[str, ...]) -> str | None:
    """What runs in place of the user's ``key=value`` of ``user`` (see :func:`overridden`), or None."""
    if key == "max_epochs" and value is not None:
        ran = epochs(value)
        return None if ran == value else f"{ran} ({'the cap' if value > MAX_EPOCHS else 'bounded'})"
    if key == "max_steps" and steps(value) != value:
        return f"{steps(value)} (the cap)"
    if key.startswith("limit_") and key[len("limit_"):-len("_batches")] in STAGES and limit(value) != value:
        return f"{limit(value)} (the cap)"
    if key == "max_time" and value is not None:
        return "no time limit (runs are bounded by epochs and batches)"
    if key == "precision" and accelerator == "cpu" and "deepspeed" in strategies and value not in _FP32:
        return "'32-true' on the [deepspeed] items (half precision under DeepSpeed needs a GPU)"
    if key == "logger" and value not in (None, False):
        needing = needing_logger(user.get("callbacks"))
        return f"a CSVLogger (callbacks {', '.join(type(c).__name__ for c in needing)} {_logger_given(needing)})" \
            if needing else "off"
    if key in FORCED and value not in (None, FORCED[key]):
        return repr(FORCED[key])
    train_limit = limit(user.get("limit_train_batches"))
    if key == "val_check_interval" and val_interval(value, train_limit) != value:
        return f"{train_limit} (within the bounded epoch of {train_limit} training batches)"
    if key == "accelerator" and value not in (None, "auto", accelerator) and not (
            accelerator == "gpu" and value == "cuda"):
        return f"{accelerator!r} (the {accelerator.upper()} tier)"
    if key == "devices" and num_nodes is not None and str(value).strip() != str(max(1, world_size // num_nodes)):
        return f"{max(1, world_size // num_nodes)} ({'the world size' if num_nodes == 1 else 'ranks per node'})"
    if key == "num_nodes" and num_nodes is not None and value != num_nodes:
        return repr(num_nodes)
    if key == "default_root_dir" and value is not None:
        return "a temporary folder per run, shared by its ranks"
    if key == "strategy" and "ddp" in strategies:
        ran = _strategy_replaced(value)
        return f"{ran} on the [ddp] items" if ran and len(strategies) > 1 else ran
    return None
