"""configure-model, rank side: what its probe observes on every rank (the package's docstring says
what the verdict makes of it).
"""

from __future__ import annotations

import math

from ..base import Probe


def _params(model) -> dict[str, tuple[int, float, int, int, str]]:
    """name -> (tensor id, value checksum, numel, bytes, device type), every parameter."""
    import torch

    out = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            meta = p.device.type == "meta"
            # A ZeRO-3 parameter is empty outside a gather: count its full size, sum this rank's partition.
            held = getattr(p, "ds_tensor", None) if hasattr(p, "ds_numel") else None
            held = p if held is None else held
            numel = int(getattr(p, "ds_numel", p.numel()))
            checksum = 0.0 if meta or held.numel() == 0 else float(held.detach().double().sum())
            out[name] = (id(p), checksum, numel, numel * p.element_size(), p.device.type)
    return out

def _group(name: str) -> str:
    """The user-facing module a parameter belongs to (wrapper prefixes dropped)."""
    parts = [p for p in name.split(".") if p not in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module",
                                                      "module", "_orig_mod")]
    return parts[0] if parts else name

def _same_values(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(a))

def _compare(before: dict, after: dict) -> dict:
    """What one hook did to the parameters, grouped by top-level module: a parameter counts as
    lost only when its values differ; a new tensor object holding the same values (a deep copy,
    a re-wrap) keeps the trained weights."""
    replaced: dict[str, dict] = {}
    changed: dict[str, dict] = {}
    not_finite = []  # [name, before, after]: a NaN or inf checksum compares nothing (neither kept nor lost)
    for name, (pid, csum, *_rest) in before.items():
        if name in after and not (math.isfinite(csum) and math.isfinite(after[name][1])):
            not_finite.append([name, csum, after[name][1]])
            continue
        if name not in after or _same_values(csum, after[name][1]):
            continue
        table = replaced if after[name][0] != pid else changed
        entry = table.setdefault(_group(name), {"n": 0, "of": 0, "before": 0.0, "after": 0.0, "moved": 0.0})
        entry["n"] += 1
        entry["moved"] += abs(after[name][1] - csum)
    for table in (replaced, changed):
        for g, entry in table.items():
            names = [n for n in before if _group(n) == g and n in after]
            entry["of"] = len(names)
            entry["before"] = sum(before[n][1] for n in names)
            entry["after"] = sum(after[n][1] for n in names)
    old_ids = {v[0] for v in before.values()}
    created = [v for v in after.values() if v[0] not in old_ids]
    return {"replaced": replaced, "changed": changed, "not_finite": not_finite,
            "removed": sorted(set(before) - set(after)),
            "created_numel": sum(v[2] for v in created), "created_bytes": sum(v[3] for v in created),
            "params_before": len(before), "params_after": len(after)}

def _group_numel(params: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, v in params.items():
        out[_group(name)] = out.get(_group(name), 0) + v[2]
    return out

def _override_site(cls, hook: str) -> str | None:
    import inspect

    fn = getattr(cls, hook, None)
    try:
        return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (TypeError, OSError):
        return None

def _has_eval(loaded, stage: str) -> bool:
    from ...target import loading as target_loading

    ns = loaded.target.namespace
    step = f"{stage}_step"
    loader = f"{'val' if stage == 'validation' else stage}_dataloader"
    if not target_loading.defines(loaded.model, step, ns):
        return False
    return target_loading.defines(loaded.model, loader, ns) or (
        loaded.datamodule is not None and target_loading.defines(loaded.datamodule, loader, ns))

def _metrics(trainer) -> dict[str, float]:
    out = {}
    for key, value in trainer.callback_metrics.items():
        try:
            out[key] = float(value)
        except Exception:
            pass
    return out

class ConfigureModelProbe(Probe):
    def __init__(self):
        self.data: dict = {"calls": [], "eval": None}
        self.trainer = None

    def before_trainer(self, loaded, trainer_kwargs, recorder):
        import importlib

        from ... import sharded

        ns = importlib.import_module(loaded.target.namespace)
        helpers = importlib.import_module(f"{ns.__name__}.utilities.model_helpers")
        model = loaded.model
        user_strategy = loaded.user_kwargs.get("strategy")
        run_strategy = trainer_kwargs.get("strategy")
        strategies = importlib.import_module(f"{ns.__name__}.strategies")
        fsdp_cls, deepspeed_cls = strategies.FSDPStrategy, strategies.DeepSpeedStrategy
        init = _params(model)
        self.data.update(
            class_name=type(model).__qualname__,
            user_sharded=sharded.sharded_kind(user_strategy),
            user_strategy=sharded.describe(user_strategy) if user_strategy is not None else None,
            zero_stage=sharded.zero_stage(user_strategy) if sharded.sharded_kind(user_strategy) == "deepspeed"
            else None,
            run_sharded=isinstance(run_strategy, fsdp_cls),
            run_deepspeed=isinstance(run_strategy, deepspeed_cls),
            init_numel=sum(v[2] for v in init.values()),
            init_bytes=sum(v[3] for v in init.values()),
            init_meta_numel=sum(v[2] for v in init.values() if v[4] == "meta"),
            init_dtypes=sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()}),
            init_groups=_group_numel(init),
            overrides_configure_model=bool(helpers.is_overridden("configure_model", model)),
            configure_model_site=_override_site(type(model), "configure_model"),
            init_site=_override_site(type(model), "__init__"),
            sharded_override_site=(_override_site(type(model), "configure_sharded_model")
                                   if helpers.is_overridden("configure_sharded_model", model) else None),
        )
        if self.data["overrides_configure_model"]:
            self._wrap(model)

    def _wrap(self, model) -> None:
        original = model.configure_model
        probe = self

        def configure_model(*args, **kwargs):
            before = _params(model)
            result = original(*args, **kwargs)
            after = _params(model)
            trainer = probe.trainer
            stage = None
            if trainer is not None and trainer.state.fn is not None:
                stage = str(getattr(trainer.state.fn, "value", trainer.state.fn))
            entry = _compare(before, after)
            entry["stage"] = stage
            probe.data["calls"].append(entry)
            return result

        model.configure_model = configure_model

    def before_fit(self, loaded, trainer, recorder):
        self.trainer = trainer

    def after_fit(self, loaded, trainer, recorder):
        stage = "validate" if _has_eval(loaded, "validation") else "test" if _has_eval(loaded, "test") else None
        if stage is None:
            return
        fit_params = _params(loaded.model)
        fit_metrics = _metrics(trainer)
        info: dict = {"stage": stage, "fit_metrics": fit_metrics, "error": None}
        try:
            with recorder.paused():
                run = trainer.validate if stage == "validate" else trainer.test
                results = run(loaded.model, datamodule=loaded.datamodule, verbose=False)
            info["eval_metrics"] = {k: float(v) for r in (results or []) for k, v in r.items()
                                    if isinstance(v, (int, float))}
        except Exception as exc:  # judged as evidence; the fit-based contracts keep their run
            info["error"] = f"{type(exc).__name__}: {exc}"
        info["weights"] = _compare(fit_params, _params(loaded.model))
        self.data["eval"] = info

    def collect(self, loaded, trainer, recorder):
        if "configure_model" in vars(loaded.model):
            del loaded.model.configure_model
        return self.data
