"""configure-model: ``configure_model`` is idempotent, the model is not built in full in
``__init__`` under a sharded strategy, and the deprecated ``configure_sharded_model`` is not used.

Seed section "FSDP": large models are built in an idempotent ``configure_model`` inside the
strategy's context; no giant unconditional allocation in ``__init__``; no
``configure_sharded_model``.

Checked on every rank of the traced fit (DDP, and CPU FSDP where configure_model runs inside
the sharded context), followed by a ``validate`` (or ``test``) on the same Trainer, which is
when Lightning calls ``configure_model`` a second time:

- each call's effect on the parameters: names, tensor identities and value checksums before and
  after; a later call that leaves parameters with other values (new tensors or in place) fails,
  with the metric the evaluation reported next to the one at the end of fit (equal values in new
  tensors lose nothing);
- the trained weights at the end of fit against those the evaluation used;
- bytes of parameters that exist after ``__init__`` against those ``configure_model`` creates,
  reported when a sharded strategy runs or the Trainer config names one; failed when
  ``__init__`` holds at least :data:`GIANT_BYTES`, more than ``configure_model`` builds;
- an override of ``configure_sharded_model``, with its file:line.
"""

from __future__ import annotations

import math

from ...outcomes import Outcome
from ..base import Contract, Evidence, Run, Verdict
from .probe import ConfigureModelProbe

# Parameter bytes built in __init__ that count as a large model under a sharded strategy.
# Below this, the measurement is reported but passes (toy and test models are fine in __init__).
GIANT_BYTES = 1 << 20

def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"

def _checksums(e: dict) -> str:
    """'checksum a -> b' for a group, at the precision at which the two differ: equal numbers are
    never shown as a difference (the group's sum can stay while its tensors change)."""
    a, b = e["before"], e["after"]
    for digits in (4, 6, 8, 10):
        if f"{a:.{digits}f}" != f"{b:.{digits}f}":
            return f"checksum {a:.{digits}f} -> {b:.{digits}f}"
    return f"group checksum {a:.4f} on both sides, per-tensor checksums moved by {e.get('moved', 0.0):.4g} in all"

class ConfigureModel(Contract):
    id = "configure-model"
    needs_finite_loss = True
    title = "configure_model is idempotent and builds the model in the strategy's context"
    rule_section = "FSDP"
    strategies = ("ddp", "fsdp", "deepspeed")
    probe_class = ConfigureModelProbe

    def judge(self, run: Run) -> Verdict:
        data = run.probe(self.id)
        ranks = [(r, d) for r, d in enumerate(data) if d]
        if not ranks:
            return self.verdict(Outcome.ERROR, "no rank returned configure_model observations.")
        first = ranks[0][1]
        cls = first.get("class_name", "Model")
        if first.get("sharded_override_site"):
            return self._sharded_override(first, cls)
        verdict = self._idempotence(run, ranks, cls) or self._allocation(run, ranks, cls)
        unjudged = _not_finite(ranks)
        if unjudged is not None:
            verdict.notes.append(unjudged[0])
            verdict.claims.append(unjudged[1])
        return verdict

    # -- configure_sharded_model -----------------------------------------------------------------
    def _sharded_override(self, first: dict, cls: str) -> Verdict:
        site = first["sharded_override_site"]
        summary = (f"{cls}.configure_sharded_model is overridden; the hook is deprecated. Lightning still calls "
                   f"it, but a sharded strategy then assumes every layer is already wrapped by hand "
                   f"(FSDP skips wrapping the whole model, so unwrapped layers are never sharded).")
        evidence = [Evidence(f"{cls}.configure_sharded_model defined here", site=site)]
        if first.get("overrides_configure_model"):
            evidence.append(Evidence(f"{cls}.configure_model is overridden too",
                                     site=first.get("configure_model_site")))
        fix = ("rename the hook to configure_model (same body), make it idempotent (return early when the layers "
               "exist), and let the strategy wrap the model (FSDP: auto_wrap_policy).")
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=fix)

    # -- idempotence and trained weights ---------------------------------------------------------
    def _idempotence(self, run: Run, ranks: list, cls: str) -> Verdict | None:
        evidence: list[Evidence] = []
        worst = None
        for r, d in ranks:
            calls = d.get("calls") or []
            for index, call in enumerate(calls[1:], start=2):
                for kind, verb in (("replaced", "replaced"), ("changed", "changed the values of")):
                    for group, e in sorted(call.get(kind, {}).items()):
                        amount = "every parameter" if e["n"] == e["of"] else f"{e['n']} of {e['of']} parameters"
                        what = "new tensor ids" if kind == "replaced" else "same tensors, new values"
                        text = (f"configure_model call {index} (during {call.get('stage')}) {verb} {amount} of "
                                f"{group} ({what}, {_checksums(e)})")
                        evidence.append(Evidence(text, rank=r, site=d.get("configure_model_site")))
                        if worst is None:
                            worst = (r, index, call, group, e, kind, amount)
        eval_info = ranks[0][1].get("eval") or {}
        weights = eval_info.get("weights") or {}
        stage = eval_info.get("stage")
        drift = {g: e for k in ("replaced", "changed") for g, e in (weights.get(k) or {}).items()}
        metric_text = self._metric_text(eval_info)
        if worst is None and not drift:
            return None
        if worst is not None:
            r, index, call, group, e, kind, amount = worst
            stages = [c.get("stage") for c in ranks[0][1].get("calls", [])]
            verb = "replaced" if kind == "replaced" else "changed the values of"
            what = "new tensor ids" if kind == "replaced" else "same tensors, new values"
            summary = (f"configure_model called {len(stages)} times ({', then '.join(map(str, stages))}) {verb} "
                       f"{amount} of {group} ({what}, {_checksums(e)}), so "
                       f"{stage or 'the evaluation'} after fit ran on weights that were never trained"
                       + (f": {metric_text}" if metric_text else "") + ". Lightning calls configure_model "
                       "again at the start of every fit, validate, test and predict.")
        else:
            groups = ", ".join(sorted(drift))
            summary = (f"the weights {stage or 'the evaluation'} used differ from those at the end of fit "
                       f"({groups})" + (f": {metric_text}" if metric_text else "") + ".")
            for g, e in sorted(drift.items()):
                evidence.append(Evidence(f"{g}: {e['n']} of {e['of']} parameters hold other values after {stage} "
                                         f"than at the end of fit ({_checksums(e)})"))
        if metric_text:
            evidence.append(Evidence(metric_text))
        fix = ("make configure_model idempotent: return early when the layers already exist (e.g. "
               "`if self.body is not None: return`), and never re-initialise existing parameters in it.")
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=fix, category="silent")

    @staticmethod
    def _metric_text(eval_info: dict) -> str | None:
        fit = eval_info.get("fit_metrics") or {}
        ev = eval_info.get("eval_metrics") or {}
        stage = eval_info.get("stage")
        shared = [k for k in ev if k in fit]
        if not shared:
            return None
        key = next((k for k in shared if "loss" in k), shared[0])
        return f"{stage}'s {key} {ev[key]:.4g} vs {fit[key]:.4g} at the end of fit"

    # -- allocation under sharded strategies -----------------------------------------------------
    def _allocation(self, run: Run, ranks: list, cls: str) -> Verdict:
        first = ranks[0][1]
        calls = first.get("calls") or []
        built = calls[0]["created_bytes"] if calls else 0
        built_numel = calls[0]["created_numel"] if calls else 0
        init_bytes, init_numel = first.get("init_bytes", 0), first.get("init_numel", 0)
        run_kind = "fsdp" if first.get("run_sharded") else "deepspeed" if first.get("run_deepspeed") else None
        sharded = first.get("user_sharded") or run_kind
        cm = ("none in configure_model (not overridden)" if not first.get("overrides_configure_model")
              else f"{built_numel:,} ({_fmt_bytes(built)}) in configure_model"
              + (" (what this rank holds after sharding)" if first.get("run_sharded") else ""))
        dtypes = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64"}
        dtype = "/".join(dtypes.get(d, d) for d in first.get("init_dtypes") or ["float32"])
        measured = f"{init_numel:,} parameters ({_fmt_bytes(init_bytes)} {dtype}) created in {cls}.__init__ and {cm}"
        eval_info = first.get("eval") or {}
        repeat = ""
        if len(calls) > 1:
            repeat = (f"; configure_model called {len(calls)} times "
                      f"({', then '.join(str(c.get('stage')) for c in calls)}), later calls kept every parameter")
        elif eval_info.get("stage"):
            repeat = f"; {eval_info['stage']} after fit used the trained weights"
        if sharded is None:
            return self.verdict(Outcome.PASSED, f"no sharded strategy in use; {measured}{repeat}.")
        if not first.get("user_sharded"):
            # Only the conformance tier shards: building in __init__ is what DDP does anyway.
            tier = "CPU FSDP tier" if run_kind == "fsdp" else "CPU DeepSpeed tier"
            return self.verdict(Outcome.PASSED, f"measured under the {tier}: {measured}{repeat}. Your Trainer "
                                f"config names no sharded strategy, so layers built in __init__ are fine; with "
                                f"FSDP or DeepSpeed, build the large ones in an idempotent configure_model.")
        where = first.get("user_strategy")
        if first.get("user_sharded") == "deepspeed" and first.get("zero_stage") == 3:
            why = "which partitions only configure_model's layers (deepspeed.zero.Init); __init__'s are built " \
                  "in full on every rank"
        elif first.get("user_sharded") == "deepspeed":
            why = "whose sharding starts only after every rank has built the whole model"
        else:
            why = "which shards the model only after every rank has built all of it (configure_model runs " \
                  "inside the sharded context, where layers can be created on the meta device and wrapped)"
        if init_bytes >= GIANT_BYTES and init_bytes > built and init_numel > first.get("init_meta_numel", 0):
            at = f" ({first['init_site']})" if first.get("init_site") else ""
            summary = f"{measured}{at} under {where}, {why}."
            evidence = [Evidence(f"{measured} (peak: the full model on each of {run.world_size} ranks)", rank=r,
                                 site=first.get("init_site")) for r, _ in ranks[:1]]
            groups = first.get("init_groups") or {}
            big = max(groups, key=groups.get) if groups else "layers"
            fix = (f"create the large layers ({big}) in configure_model, guarded so a second call returns early "
                   f"(`if self.{big} is not None: return`), and keep only small, cheap state in __init__.")
            return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=fix)
        return self.verdict(Outcome.PASSED, f"under {where}: {measured} (under the {_fmt_bytes(GIANT_BYTES)} "
                            f"large-model threshold or built in configure_model){repeat}.")

CONTRACT = ConfigureModel()


def _not_finite(ranks: list) -> tuple[str, object] | None:
    """(note, claim) naming the parameters whose checksum is NaN or inf before or after a
    configure_model call or the evaluation's load: they were neither kept nor lost, not compared."""
    from ...claims import claim

    for r, d in ranks:
        calls = [(f"configure_model call {i}", c) for i, c in enumerate(d.get("calls") or [], start=1)]
        calls.append((f"the {(d.get('eval') or {}).get('stage') or 'evaluation'} load",
                      (d.get("eval") or {}).get("weights") or {}))
        for where, c in calls:
            bad = c.get("not_finite") or []
            if not bad:
                continue
            name, before, after = bad[0]
            values = [v for v in (before, after) if not math.isfinite(v)]
            word = "NaN" if all(math.isnan(v) for v in values) else \
                "inf" if not any(math.isnan(v) for v in values) else "NaN/inf"
            more = f" and {len(bad) - 1} more parameter(s)" if len(bad) > 1 else ""
            text = (f"parameter {name}{more} not judged, because the value is {word} on rank {r} (its checksum "
                    f"{before} before and {after} after {where}), so whether its weights were kept is unknown")
            return text, claim("not-finite", text, values={"before": before, "after": after})
    return None
