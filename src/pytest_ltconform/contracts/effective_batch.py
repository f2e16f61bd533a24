"""effective-batch: what one optimizer step really averages over, and whether the gradient is
the same whatever the world size.

Seed section "Choose using measured memory": the effective batch is the local batch times the
world size times the accumulation, for full accumulation windows; a partial final window, token
masks and uneven ranks need their own accounting; linear learning-rate scaling is a hypothesis.

Checked in a run of kind "ebatch": the world trains one optimizer step (one full accumulation
window) with each rank's micro-batches, the initial weights and the averaged first-step gradient
saved; then a one-rank reference run (``REFERENCE_RUNS``) loads the same weights and trains one
step on the same samples, the ranks' micro-batches concatenated (1 rank x batch world*b). With a
mean-reduced loss the two gradients agree; a sum-reduced loss under DDP's gradient averaging, or a
per-rank normalisation by a local count, changes them by a factor, which fails with the factor
and the loss line. The effective batch, a partial final window and an uneven last batch are
reported (informational: they pass). Dropout is switched off in both runs so that only the
reduction is compared.
"""

from __future__ import annotations

import math
import os
import re

from ..sites import fmt_site
from .base import Contract, Evidence, Run, Verdict

TOLERANCE = 0.10  # relative gap between the two gradient norms that fails

# -- rank side ---------------------------------------------------------------------------------


def _to_cpu(batch):
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.detach().cpu().clone()
    if isinstance(batch, dict):
        return {k: _to_cpu(v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*[_to_cpu(v) for v in batch])
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_cpu(v) for v in batch)
    return batch


def _concat(items: list):
    """One batch from the ranks' batches: tensors concatenated along dim 0, containers per field."""
    import torch

    first = items[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(items) if first.dim() > 0 else torch.stack(items)
    if isinstance(first, dict):
        return {k: _concat([it[k] for it in items]) for k in first}
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*[_concat(list(parts)) for parts in zip(*items)])
    if isinstance(first, tuple):
        return tuple(_concat(list(parts)) for parts in zip(*items))
    if isinstance(first, list):
        if all(isinstance(x, (str, int, float)) for it in items for x in it):
            return [x for it in items for x in it]
        return [_concat(list(parts)) for parts in zip(*items)]
    return first


class _Replay:
    """An iterable of fixed batches (Lightning treats it as one train dataloader)."""

    def __init__(self, batches: list):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


def _no_dropout(module) -> int:
    import torch

    count = 0
    for m in module.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            m.p = 0.0
            count += 1
    return count


def _loss_lines(model) -> list[dict]:
    """Lines of training_step (and what it calls on self) that sum a loss or divide by a count."""
    import inspect

    patterns = [(re.compile(r"reduction\s*=\s*['\"]sum['\"]"), "reduction='sum'"),
                (re.compile(r"/\s*[\w.\[\]()]*\.sum\(\)"), "divides by a local count (x / mask.sum())"),
                (re.compile(r"\.sum\(\)\s*$|\.sum\(\)\s*#"), "sums over the batch")]
    found = []
    for name in ("training_step", "compute_loss", "loss", "_shared_step", "shared_step", "step"):
        method = getattr(type(model), name, None)
        if method is None or not callable(method):
            continue
        try:
            lines, start = inspect.getsourcelines(method)
            path = inspect.getsourcefile(method)
        except (TypeError, OSError):
            continue
        for i, line in enumerate(lines):
            code = line.split("#", 1)[0]
            for rx, what in patterns:
                if rx.search(code):
                    found.append({"file": path, "line": start + i, "func": method.__qualname__, "what": what,
                                  "text": line.strip()[:120]})
                    break
    return found[:3]


def _loader_facts(trainer) -> dict:
    from torch.utils.data import DataLoader

    loader = trainer.train_dataloader
    if isinstance(loader, (list, tuple)):
        loader = loader[0] if loader else None
    if isinstance(loader, dict):
        loader = next(iter(loader.values()), None)
    facts: dict = {"batches": None, "samples": None, "batch_size": None, "drop_last": None}
    if isinstance(loader, DataLoader):
        facts["batch_size"] = loader.batch_size
        facts["drop_last"] = bool(loader.drop_last)
        try:
            facts["batches"] = len(loader)
        except TypeError:
            pass
        sampler = getattr(loader.batch_sampler, "sampler", None) or loader.sampler
        try:
            facts["samples"] = len(sampler)
        except TypeError:
            pass
    return facts


def _make_callback(ns, state: dict, rank: int, folder: str, reference_grads: str | None = None):
    import torch

    class Capture(ns.Callback):
        def on_train_start(self, trainer, pl_module):
            state["dropout_off"] = _no_dropout(pl_module)
            if reference_grads is None:
                if rank == 0:
                    torch.save(pl_module.state_dict(), os.path.join(folder, "ebatch_weights.pt"))
            else:
                weights = torch.load(os.path.join(folder, "ebatch_weights.pt"), map_location="cpu",
                                     weights_only=False)
                pl_module.load_state_dict(weights)
            try:
                state["loader"] = _loader_facts(trainer)
            except Exception as exc:
                state["loader"] = {"error": repr(exc)}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 0 and not state.get("stepped"):
                state["batches"].append(_to_cpu(batch))
                from .data_sharding import batch_size_of

                state["sizes"].append(batch_size_of(batch))

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if state.get("stepped"):
                return
            state["stepped"] = True
            grads = {n: p.grad.detach().cpu().clone() for n, p in pl_module.named_parameters()
                     if p.grad is not None}
            state["norm"] = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))) if grads else 0.0
            if reference_grads is None:
                if rank == 0:
                    torch.save(grads, os.path.join(folder, "ebatch_grads.pt"))
            else:
                other = torch.load(reference_grads, map_location="cpu", weights_only=False)
                names = [n for n in grads if n in other]
                dot = sum(float((grads[n].double() * other[n].double()).sum()) for n in names)
                norm_other = math.sqrt(sum(float((other[n].double() ** 2).sum()) for n in names))
                norm_here = math.sqrt(sum(float((grads[n].double() ** 2).sum()) for n in names))
                state["world_norm"] = norm_other
                state["cosine"] = dot / (norm_other * norm_here) if norm_other and norm_here else None
                per = []
                for n in names:
                    a, b = float(other[n].double().norm()), float(grads[n].double().norm())
                    if b > 0:
                        per.append((n, a / b))
                state["per_param"] = per[:8]

    return Capture()


def _one_step_kwargs(user: dict, strategy, world_size: int, root: str, micro_batches: int) -> dict:
    from ..runs import build_trainer_kwargs

    kwargs = build_trainer_kwargs({k: v for k, v in user.items() if k != "strategy"}, strategy, world_size, root)
    # One epoch of exactly one accumulation window: one optimizer step, and the epoch's usual
    # hooks (validation, on_fit_end) still run as the user's code expects.
    kwargs.update(max_steps=-1, max_epochs=1, limit_train_batches=micro_batches)
    kwargs.pop("val_check_interval", None)
    return kwargs


def observe(ctx, targets, strategy_name: str, contract_ids: list[str], pg_timeout_s: float) -> dict:
    """Rank-side function of run kind "ebatch": one optimizer step of the world, saved for the
    one-rank reference."""
    import torch

    from ..runs import Loaded, adapt_strategy

    loaded = Loaded(targets)
    ns = loaded.ns
    user = dict(loaded.user_kwargs)
    accumulate = user.get("accumulate_grad_batches", 1)
    accumulate = accumulate if isinstance(accumulate, int) and accumulate > 0 else 1
    folder = os.path.dirname(ctx.job_dir)
    strategy = adapt_strategy(ns, strategy_name, user.get("strategy"), pg_timeout_s)
    kwargs = _one_step_kwargs(user, strategy, ctx.world_size, ctx.job_dir, accumulate)
    state: dict = {"batches": [], "sizes": []}
    kwargs["callbacks"] = list(kwargs.get("callbacks") or []) + [_make_callback(ns, state, ctx.rank, folder)]
    trainer = ns.Trainer(**kwargs)
    trainer.fit(loaded.model, datamodule=loaded.datamodule)
    torch.save(state["batches"], os.path.join(folder, f"ebatch_batches_rank{ctx.rank}.pt"))
    out = {"ebatch": {"sizes": state["sizes"], "accumulate": accumulate, "norm": state.get("norm"),
                      "stepped": bool(state.get("stepped")), "loader": state.get("loader"),
                      "dropout_off": state.get("dropout_off", 0), "manual": not loaded.model.automatic_optimization,
                      "loss_lines": _loss_lines(loaded.model) if ctx.rank == 0 else []}}
    if ctx.rank == 0 and state.get("stepped"):
        out["reference_args"] = [folder, ctx.world_size, accumulate]
    return out


def reference(ctx, targets, folder: str, world: int, accumulate: int, pg_timeout_s: float) -> dict:
    """One rank, the same weights, one step on the world's micro-batches concatenated."""
    import torch

    from ..runs import Loaded, adapt_strategy

    loaded = Loaded(targets)
    ns = loaded.ns
    per_rank = [torch.load(os.path.join(folder, f"ebatch_batches_rank{r}.pt"), map_location="cpu",
                           weights_only=False) for r in range(world)]
    micro = min(len(b) for b in per_rank)
    combined = [_concat([per_rank[r][j] for r in range(world)]) for j in range(micro)]
    strategy = adapt_strategy(ns, "ddp", None, pg_timeout_s)
    kwargs = _one_step_kwargs(dict(loaded.user_kwargs), strategy, 1, ctx.job_dir, micro)
    state: dict = {"batches": [], "sizes": []}
    kwargs["callbacks"] = list(kwargs.get("callbacks") or []) + \
        [_make_callback(ns, state, 0, folder, reference_grads=os.path.join(folder, "ebatch_grads.pt"))]
    trainer = ns.Trainer(**kwargs)
    # The same samples come from wherever the user's train_dataloader lives; the rest of the
    # datamodule (validation, setup) stays the user's.
    from ..target import defines

    replay = _Replay(combined)
    dm = loaded.datamodule
    holder = dm if dm is not None and defines(dm, "train_dataloader", targets.namespace) else loaded.model
    object.__setattr__(holder, "train_dataloader", lambda: replay)
    trainer.fit(loaded.model, datamodule=dm)
    return {"reference": {"norm": state.get("norm"), "world_norm": state.get("world_norm"),
                          "cosine": state.get("cosine"), "per_param": state.get("per_param"),
                          "sizes": state["sizes"], "stepped": bool(state.get("stepped"))}}


# -- pytest side -------------------------------------------------------------------------------

def _close(a: float, b: float, rel: float = 0.05) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


class EffectiveBatch(Contract):
    id = "effective-batch"
    title = "The effective batch is reported and the gradient does not depend on the world size"
    seed = "Choose using measured memory"
    run_kind = "ebatch"
    strategies = ("ddp",)
    tiers = ("cpu",)  # the one-rank reference run exists on the local CPU tier only

    def judge(self, run: Run) -> Verdict:
        values = [(v or {}).get("ebatch") for v in run.values()]
        info = values[0]
        if not info:
            return self.verdict("error", "the one-step run returned nothing", diagnosis=run.job.failure_text())
        world = run.world_size
        local = info["sizes"][0] if info["sizes"] else None
        acc = info["accumulate"]
        report, notes = self._report(values, local, world, acc)
        ref_run = getattr(run, "reference", None)
        ref = (ref_run.value(0) or {}).get("reference") if ref_run is not None and ref_run.finished else None
        if not info.get("stepped"):
            return self.verdict("passed", report + " No optimizer step was taken in the first window, so the "
                                "gradients were not compared.", notes=notes)
        if not ref or not ref.get("stepped") or ref.get("norm") is None:
            why = "no reference run" if ref_run is None else (
                ref_run.job.failure_text().splitlines()[0] if ref_run.job.failure_text() else "it did not step")
            return self.verdict("error", report + f" The one-rank reference step could not be made ({why}), so "
                                "world-size invariance was not judged.",
                                diagnosis=ref_run.job.failure_text() if ref_run is not None else None)
        n_world, n_ref = ref["world_norm"], ref["norm"]
        ratio = n_world / n_ref if n_ref else float("inf")
        cos = ref.get("cosine")
        samples = sum(sum(s or 0 for s in (v or {}).get("sizes", [])) for v in values)
        measured = (f"first-step gradient norm {n_world:.4g} on {world} ranks x batch {local} vs {n_ref:.4g} on 1 rank "
                    f"x batch {world * (local or 0)}, same {samples} samples and weights (ratio {ratio:.3g}"
                    + (f", cosine {cos:.4f}" if cos is not None else "") + ")")
        if cos is not None and cos < 0.99:
            notes.append(f"the gradient direction differs too (cosine {cos:.3f}): batch statistics (BatchNorm without "
                         f"SyncBatchNorm) or per-rank weighting make the step depend on how samples are split.")
        if info.get("dropout_off"):
            notes.append(f"{info['dropout_off']} dropout module(s) were switched off in both runs for the comparison.")
        if abs(ratio - 1.0) <= TOLERANCE:
            return self.verdict("passed", f"{report} The {measured}: world-size invariant.", notes=notes)
        lines = info.get("loss_lines") or []
        if _close(ratio, 1.0 / world):
            factor = (f"the gradient shrinks by the world size ({world}): the loss scales with the number of "
                      f"samples on a rank (a sum-reduced loss) and DDP averages gradients over ranks")
        elif _close(ratio, float(world)):
            factor = (f"the gradient grows with the world size ({world}): the loss or gradient is multiplied by the "
                      f"world size, or gradients are summed rather than averaged")
        else:
            factor = (f"the gradient changes by a factor {ratio:.3g} that is not the world size: each rank normalises "
                      f"by its own count (tokens, valid samples), so ranks are weighted unequally")
        line_text = "; ".join(f"{ln['what']} at {fmt_site(ln)}" for ln in lines)
        summary = f"{measured}: {factor}" + (f" ({line_text})" if line_text else "") + f". {report}"
        evidence = [Evidence(f"first-step gradient norm {n_world:.4g} (averaged over {world} ranks, batch {local} "
                             f"each)", rank=None),
                    Evidence(f"first-step gradient norm {n_ref:.4g} on 1 rank, batch {world * (local or 0)}, same "
                             f"samples and weights", rank=None)]
        for ln in lines:
            evidence.append(Evidence(f"{ln['what']}: {ln['text']}", site=fmt_site(ln)))
        for name, r in (ref.get("per_param") or [])[:3]:
            evidence.append(Evidence(f"parameter {name}: gradient ratio {r:.3g}"))
        fix = ("use a mean-reduced loss (reduction='mean'), or normalise by the global count (all-reduce the "
               "token/sample count and divide by it, times the world size to undo DDP's averaging); if the scale is "
               "intended, scale the learning rate on purpose and report the effective batch next to it.")
        return self.verdict("failed", summary, evidence=evidence, fix=fix, category="silent", notes=notes)

    @staticmethod
    def _report(values: list, local, world: int, acc: int) -> tuple[str, list[str]]:
        eff = (local or 0) * world * acc
        report = (f"Effective batch {eff} = {local} (per rank) x {world} (ranks) x {acc} (accumulation) for full "
                  f"windows.")
        notes = []
        loaders = [(v or {}).get("loader") or {} for v in values]
        batches = [ld.get("batches") for ld in loaders]
        samples = [ld.get("samples") for ld in loaders]
        bs = loaders[0].get("batch_size") if loaders else None
        if batches[0] and acc > 1 and batches[0] % acc:
            rest = batches[0] % acc
            notes.append(f"partial final window: an epoch has {batches[0]} batches per rank, so its last optimizer "
                         f"step averages {rest} of {acc} micro-batches (effective batch {(local or 0) * world * rest} "
                         f"there).")
        if bs and samples[0] and not loaders[0].get("drop_last") and samples[0] % bs:
            last = samples[0] % bs
            notes.append(f"uneven last batch: {samples[0]} samples per rank with batch size {bs} leave a last batch of "
                         f"{last} per rank (drop_last=False), so that step averages {last * world} samples.")
        if len({b for b in batches if b is not None}) > 1:
            notes.append("ranks have different numbers of batches per epoch: "
                         + ", ".join(f"rank {r}: {b}" for r, b in enumerate(batches)))
        return report, notes


CONTRACT = EffectiveBatch()
