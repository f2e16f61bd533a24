"""Rank side of effective-batch: one optimizer step of the world, and its one-rank reference.

``one_step`` (every rank) trains one full accumulation window, saves the initial weights and the
averaged first-step gradient (rank 0) and each rank's micro-batches; ``reference`` (one rank) loads
the same weights and trains one step on the ranks' micro-batches concatenated, then compares the
two gradients. Both build their Trainer through the harness, untraced. Imported only in ranks.
"""

from __future__ import annotations

import math
import os
import re

from ...harness import Probe, RankRun, batch_size, rank_run
from ...target import defines


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




def _grad_comparison(grads: dict, other: dict) -> dict:
    """Norms, cosine and per-parameter ratios of the world's gradient ``other`` against ``grads``."""
    names = [n for n in grads if n in other]
    dot = sum(float((grads[n].double() * other[n].double()).sum()) for n in names)
    norm_other = math.sqrt(sum(float((other[n].double() ** 2).sum()) for n in names))
    norm_here = math.sqrt(sum(float((grads[n].double() ** 2).sum()) for n in names))
    per = []
    for n in names:
        a, b = float(other[n].double().norm()), float(grads[n].double().norm())
        if b > 0:
            per.append((n, a / b))
    return {"world_norm": norm_other,
            "cosine": dot / (norm_other * norm_here) if norm_other and norm_here else None,
            "per_param": per[:8]}


class EffectiveBatchProbe(Probe):
    """Captures the first optimizer step: the micro-batches and their sizes, the gradient norm,
    the train loader's facts. In the world (``reference_grads`` None) rank 0 saves the initial
    weights and the gradient; in the reference the world's weights are loaded first and the
    gradient is compared with the world's (``reference_grads``: its file)."""

    def __init__(self, folder: str = "", reference_grads: str | None = None):
        self.folder = folder
        self.reference_grads = reference_grads
        self.rank = 0
        self.state: dict = {"batches": [], "sizes": []}

    def before_trainer(self, objects, trainer_kwargs, recorder) -> None:
        trainer_kwargs["callbacks"] = list(trainer_kwargs.get("callbacks") or []) + \
            [_make_callback(objects.ns, self)]

    def train_start(self, pl_module, trainer) -> None:
        import torch

        state = self.state
        state["dropout_off"] = _no_dropout(pl_module)
        weights = os.path.join(self.folder, "ebatch_weights.pt")
        if self.reference_grads is None:
            if self.rank == 0:
                torch.save(pl_module.state_dict(), weights)
        else:
            pl_module.load_state_dict(torch.load(weights, map_location="cpu", weights_only=False))
        try:
            state["loader"] = _loader_facts(trainer)
        except Exception as exc:
            state["loader"] = {"error": repr(exc)}

    def batch_start(self, trainer, batch) -> None:
        if trainer.global_step == 0 and not self.state.get("stepped"):
            self.state["batches"].append(_to_cpu(batch))
            self.state["sizes"].append(batch_size(batch))

    def before_step(self, pl_module) -> None:
        import torch

        state = self.state
        if state.get("stepped"):
            return
        state["stepped"] = True
        grads = {n: p.grad.detach().cpu().clone() for n, p in pl_module.named_parameters() if p.grad is not None}
        state["norm"] = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))) if grads else 0.0
        if self.reference_grads is None:
            if self.rank == 0:
                torch.save(grads, os.path.join(self.folder, "ebatch_grads.pt"))
        else:
            other = torch.load(self.reference_grads, map_location="cpu", weights_only=False)
            state.update(_grad_comparison(grads, other))


def _make_callback(ns, probe: EffectiveBatchProbe):
    class Capture(ns.Callback):
        def on_train_start(self, trainer, pl_module):
            probe.train_start(pl_module, trainer)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            probe.batch_start(trainer, batch)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            probe.before_step(pl_module)

    return Capture()


def _one_step_kwargs(run: RankRun, user: dict, strategy, world_size: int, micro_batches: int) -> dict:
    kwargs = run.trainer_kwargs(strategy, {k: v for k, v in user.items() if k != "strategy"}, world_size)
    # One epoch of exactly one accumulation window: one optimizer step, and the epoch's usual
    # hooks (validation, on_fit_end) still run as the user's code expects.
    kwargs.update(max_steps=-1, max_epochs=1, limit_train_batches=micro_batches)
    kwargs.pop("val_check_interval", None)
    return kwargs


def one_step(ctx, targets, strategy_name: str, probes: list, pg_timeout_s: float) -> dict:
    """Every rank: one optimizer step of the world, saved for the one-rank reference. Returns
    ``{"ebatch": {...}, "reference_args": [folder, world, accumulation] (rank 0, after a step)}``."""
    import torch

    folder = os.path.dirname(ctx.job_dir)
    with rank_run(ctx, targets, probes, pg_timeout_s, traced=False) as run:
        probe = next(p for p in run.probes.values() if isinstance(p, EffectiveBatchProbe))
        probe.folder, probe.rank = folder, ctx.rank
        objects = run.objects
        user = dict(objects.user_kwargs)
        accumulate = user.get("accumulate_grad_batches", 1)
        accumulate = accumulate if isinstance(accumulate, int) and accumulate > 0 else 1
        strategy = run.strategy(strategy_name, user.get("strategy"))
        trainer = run.build_trainer(_one_step_kwargs(run, user, strategy, ctx.world_size, accumulate))
        trainer.fit(objects.model, datamodule=objects.datamodule)
        state = probe.state
        torch.save(state["batches"], os.path.join(folder, f"ebatch_batches_rank{ctx.rank}.pt"))
        out = {"ebatch": {"sizes": state["sizes"], "accumulate": accumulate, "norm": state.get("norm"),
                          "stepped": bool(state.get("stepped")), "loader": state.get("loader"),
                          "dropout_off": state.get("dropout_off", 0),
                          "manual": not objects.model.automatic_optimization,
                          "loss_lines": _loss_lines(objects.model) if ctx.rank == 0 else []}}
    if ctx.rank == 0 and state.get("stepped"):
        out["reference_args"] = [folder, ctx.world_size, accumulate]
    return out


def reference(ctx, targets, folder: str, world: int, accumulate: int, pg_timeout_s: float) -> dict:
    """One rank, the same weights, one step on the world's micro-batches concatenated."""
    import torch

    probe = EffectiveBatchProbe(folder, reference_grads=os.path.join(folder, "ebatch_grads.pt"))
    with rank_run(ctx, targets, [("reference", probe)], pg_timeout_s, traced=False) as run:
        objects = run.objects
        per_rank = [torch.load(os.path.join(folder, f"ebatch_batches_rank{r}.pt"), map_location="cpu",
                               weights_only=False) for r in range(world)]
        micro = min(len(b) for b in per_rank)
        combined = [_concat([per_rank[r][j] for r in range(world)]) for j in range(micro)]
        strategy = run.strategy("ddp", None)
        trainer = run.build_trainer(_one_step_kwargs(run, dict(objects.user_kwargs), strategy, 1, micro))
        # The same samples come from wherever the user's train_dataloader lives; the rest of the
        # datamodule (validation, setup) stays the user's.
        replay = _Replay(combined)
        dm = objects.datamodule
        holder = dm if dm is not None and defines(dm, "train_dataloader", targets.namespace) else objects.model
        object.__setattr__(holder, "train_dataloader", lambda: replay)
        trainer.fit(objects.model, datamodule=dm)
    state = probe.state
    return {"reference": {"norm": state.get("norm"), "world_norm": state.get("world_norm"),
                          "cosine": state.get("cosine"), "per_param": state.get("per_param"),
                          "sizes": state["sizes"], "stepped": bool(state.get("stepped"))}}
