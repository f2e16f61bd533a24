"""Rank side of effective-batch: one optimizer step of the world, and its one-rank reference.

``one_step`` (every rank) trains up to the first optimizer step (one accumulation window; with
manual optimization, the training_step calls before the first ``optimizer.step``). Every rank
records its gradient's signature (is it the same on every rank, i.e. did DDP average it?), the
sample indices its sampler yielded for the window, its micro-batches, and what each
``manual_backward`` passed in; rank 0 saves the initial weights, the averaged gradient, and the
window's samples merged through the user's own dataset and collate_fn. ``reference`` (one rank)
loads the same weights and trains one step on the merged samples twice, under two RNG seeds, and
compares the gradients. Both build their Trainer through the harness, untraced, with DDP kept
going the way the shared fit does (find_unused_parameters forced on unless static_graph).
Imported only in ranks.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import re

from ...harness import RankRun, batch_size, rank_run
from ...runs import Probe, RunArgs
from ...sites import user_site
from ...target.loading import defines
from . import window

MANUAL_LIMIT = 8  # training batches a manually optimized world may take to reach its first step


class _Replay:
    """Fixed batches in place of the user's train loader (Lightning treats it as one train
    dataloader): iterating yields the batches; every other attribute (``dataset``, ``batch_size``,
    ``sampler``, ...) is the user's loader's, since the module's own hooks may read them."""

    def __init__(self, batches: list, loader=None):
        self.batches = batches
        self.loader = loader

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)

    def __getattr__(self, name):
        loader = self.__dict__.get("loader")
        if loader is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(loader, name)


def _no_dropout(module) -> int:
    import torch

    count = 0
    for m in module.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            m.p = 0.0
            count += 1
        elif isinstance(m, torch.nn.MultiheadAttention) and m.dropout > 0:
            m.dropout = 0.0  # attention dropout is a float inside the module, not a Dropout child
            count += 1
    return count


def batch_stats_off(module) -> tuple[list[str], list[str]]:
    """Put every layer that normalises by the statistics of the batch it is given (BatchNorm*,
    not SyncBatchNorm) in eval mode. Returns ``(frozen, still_coupled)`` class names; still
    coupled: no running statistics (track_running_stats=False), so eval mode keeps the batch's.
    In training mode a sample's output depends on the other samples of its batch, so 2 ranks x b
    and 1 rank x 2b compute different functions and their gradients cannot be compared (seed
    "Choose using measured memory"); both runs freeze them alike."""
    import torch

    frozen, coupled = [], []
    for m in module.modules():
        if not isinstance(m, torch.nn.modules.batchnorm._BatchNorm) or isinstance(m, torch.nn.SyncBatchNorm):
            continue
        if getattr(m, "running_mean", None) is None:
            coupled.append(f"{type(m).__name__}(track_running_stats=False)")
        elif m.training:
            m.eval()
            frozen.append(type(m).__name__)
    return frozen, coupled


def _loss_methods(model):
    """training_step and what it calls on self, then the forward of each loss module the model
    holds (a child named or typed "loss", outside torch), where a package keeps its reduction."""
    for name in ("training_step", "compute_loss", "loss", "_shared_step", "shared_step", "step"):
        yield getattr(type(model), name, None)
    for attr, child in model.named_children():
        cls = type(child)
        if "loss" in (attr + cls.__name__).lower() and not cls.__module__.startswith("torch."):
            yield getattr(cls, "forward", None)


def _loss_lines(model) -> list[dict]:
    """Lines of the loss code (:func:`_loss_methods`) that sum a loss or divide by a count."""
    import inspect

    patterns = [(re.compile(r"reduction\s*=\s*['\"]sum['\"]"), "reduction='sum'"),
                (re.compile(r"/\s*[\w.\[\]()]*\.sum\(\)"), "divides by a local count (x / mask.sum())"),
                (re.compile(r"\bignore_index\s*="), "averages over this rank's tokens not ignored (ignore_index)"),
                (re.compile(r"\.sum\(\)\s*$|\.sum\(\)\s*#|\breturn\b.*\.sum\(\)\s*(\*|$)"),
                 "sums over the batch")]
    # A loss module built with reduction="sum" (the value may come from a constant or a config):
    # named where the loss code calls it.
    for attr, child in model.named_children():
        if getattr(child, "reduction", None) == "sum":
            patterns.append((re.compile(rf"\bself\.{re.escape(attr)}\s*\("),
                             f"self.{attr} is {type(child).__name__}(reduction='sum')"))
    found = []
    for method in _loss_methods(model):
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


def _train_loader(trainer):
    loader = trainer.train_dataloader
    if isinstance(loader, (list, tuple)):
        loader = loader[0] if loader else None
    if isinstance(loader, dict):
        loader = next(iter(loader.values()), None)
    return loader


def _loader_facts(loader) -> dict:
    from torch.utils.data import DataLoader

    facts: dict = {"batches": None, "samples": None, "batch_size": None, "drop_last": None,
                   "type": type(loader).__name__}
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


def _norm(grads: dict) -> float:
    return math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))


def _rel_diff(grads: dict, other: dict) -> float:
    """``|grads - other| / |other|`` over the parameters both hold (inf when the sets differ)."""
    if set(grads) != set(other):
        return float("inf")
    diff = math.sqrt(sum(float(((grads[n].double() - other[n].double()) ** 2).sum()) for n in grads))
    base = _norm(other)
    return diff / base if base else (0.0 if diff == 0 else float("inf"))


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


def _grads(pl_module) -> dict:
    return {n: p.grad.detach().cpu().clone() for n, p in pl_module.named_parameters() if p.grad is not None}


class EffectiveBatchProbe(Probe):
    """Captures the first optimizer step: the window's micro-batches, sizes and sample indices,
    what each backward received, the gradient at the step. In the world rank 0 saves the initial
    weights, the gradient and the merged samples; in the reference (``seed`` set) the saved weights
    are loaded and every micro-batch starts from a known RNG seed."""

    def __init__(self, folder: str = "", seed: int | None = None):
        self.folder = folder
        self.seed = seed
        self.rank = 0
        self.state: dict = {"batches": [], "sizes": [], "backwards": [], "scales": []}
        self.grads: dict = {}
        self.loader = None
        self.indices = None
        self.recorders: dict = {}
        self.after_backward: dict | None = None

    def before_trainer(self, objects, trainer_kwargs, recorder) -> None:
        trainer_kwargs["callbacks"] = list(trainer_kwargs.get("callbacks") or []) + \
            [_make_callback(objects.ns, self)]

    def setup(self, trainer) -> None:
        strategy = trainer.strategy
        original = strategy.backward
        process = strategy.process_dataloader
        recorders = self.recorders = {}

        def process_dataloader(dataloader):
            # Lightning creates the train iterator before on_train_start: record indices from here.
            out = process(dataloader)
            if self.seed is None:
                recorder = window.record_indices(out)
                if recorder is not None:
                    recorders[id(out)] = recorder
            return out

        strategy.process_dataloader = process_dataloader

        def backward(loss, *args, **kwargs):
            scale = None if self.state.get("stepped") else window.root_scale(loss)  # before the graph is freed
            self.note_backward("no_sync" if _sync_off(strategy) else "synced")
            IN_STRATEGY["on"] = True
            try:
                out = original(loss, *args, **kwargs)
            finally:
                IN_STRATEGY["on"] = False
            self.backward_done(trainer, scale)
            return out

        strategy.backward = backward

    def note_backward(self, kind: str) -> None:
        """The last backward before the first step: ``synced`` (through the strategy, DDP's reducer
        armed), ``no_sync`` (through the strategy with DDP's gradient sync off) or ``plain`` (a
        ``Tensor.backward``/``torch.autograd.backward`` not run by the strategy), with the user's line."""
        if self.state.get("stepped") or not self.state["backwards"]:
            return
        self.state["last_backward"] = {"kind": kind, "site": user_site(3)[0]}

    def backward_done(self, trainer, scale: float | None) -> None:
        state = self.state
        if state.get("stepped") or not state["backwards"]:
            return
        state["backwards"][-1] += 1
        state["scales"].append(scale)
        if "backward_site" not in state:
            state["backward_site"] = user_site(1)[0]
        self.after_backward = _grads(trainer.lightning_module)

    def train_start(self, pl_module, trainer) -> None:
        import torch

        state = self.state
        state["dropout_off"] = _no_dropout(pl_module)
        weights = os.path.join(self.folder, "ebatch_weights.pt")
        if self.seed is None:
            if self.rank == 0:
                torch.save(pl_module.state_dict(), weights)
            self.loader = _train_loader(trainer)
            self.indices = self.recorders.get(id(self.loader))
        else:
            pl_module.load_state_dict(torch.load(weights, map_location="cpu", weights_only=False))
            window.seed_all(self.seed)
        try:
            state["loader"] = _loader_facts(self.loader)
        except Exception as exc:
            state["loader"] = {"error": repr(exc)}

    def batch_start(self, trainer, batch, batch_idx: int) -> None:
        state = self.state
        if state.get("stepped"):
            return
        # Lightning puts the module back in train mode (after validation): freeze before each step.
        frozen, coupled = batch_stats_off(trainer.lightning_module)
        state.setdefault("batch_stats_off", []).extend(frozen)
        state["batch_stats_n"] = max(state.get("batch_stats_n", 0), len(frozen))
        state.setdefault("batch_coupled", []).extend(coupled)
        state["batches"].append(window.to_cpu(batch))
        state["sizes"].append(batch_size(batch))
        state["backwards"].append(0)
        if self.seed is not None:
            window.seed_all(self.seed * 1000 + batch_idx)

    def before_step(self, pl_module) -> None:
        state = self.state
        if state.get("stepped"):
            return
        state["stepped"] = True
        self._count_items()
        self.grads = grads = _grads(pl_module)
        state["norm"] = _norm(grads)
        ignored = set(getattr(pl_module, "_ddp_params_and_buffers_to_ignore", ()) or ())  # DDP never syncs these
        state["grad_sig"] = [(n, float(g.double().norm())) for n, g in grads.items() if n not in ignored]
        if self.after_backward is not None:
            state["sum_norm"] = _norm(self.after_backward)
            state["after_backward_diff"] = _rel_diff(grads, self.after_backward)
        if self.seed is None:
            self._share_window()

    def _count_items(self) -> None:
        """The dataset items of each micro-batch of the window: the keys its fetch handed the
        dataset (a collated graph's atoms or a padded sequence's rows are not items)."""
        n = len(self.state["sizes"])
        lists = self.indices.lists[:n] if self.indices is not None and len(self.indices.lists) >= n else None
        if lists is not None:
            self.state["items"] = [len(x) for x in lists]
            self.state["item_keys"] = [k if isinstance(k, int) else repr(k)[:60] for x in lists for k in x][:10_000]

    def _share_window(self) -> None:
        """World: rank 0 saves the averaged gradient and the window's samples merged through the
        user's dataset and collate_fn (every rank's index lists gathered first)."""
        import torch
        import torch.distributed as dist

        n = len(self.state["sizes"])
        mine = self.indices.lists[:n] if self.indices is not None and len(self.indices.lists) >= n else None
        gathered = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        if self.rank != 0:
            return
        torch.save(self.grads, os.path.join(self.folder, "ebatch_grads.pt"))
        if any(g is None for g in gathered):
            self.state["merge_note"] = "the sampler's indices were not recorded (an iterable or unbatched loader)"
            return
        merged, why = window.merged_by_loader(self.loader, gathered, n)
        if merged is not None:
            try:
                torch.save(merged, os.path.join(self.folder, "ebatch_merged.pt"))
            except Exception as exc:  # a batch object pickle cannot store
                merged, why = None, f"the merged batch could not be saved ({exc!r:.120})"
        self.state["merge_note"] = why


# Whether the strategy's backward is under way: a torch backward outside it bypasses DDP's reducer.
IN_STRATEGY = {"on": False}


def _sync_off(strategy) -> bool:
    """Whether DDP's gradient sync is off for the next backward (``no_sync``): the DDP wrapper's
    ``require_backward_grad_sync``; False for any other model."""
    model = getattr(strategy, "model", None)
    return getattr(model, "require_backward_grad_sync", True) is False and hasattr(model, "reducer")


@contextlib.contextmanager
def plain_backwards(probe: EffectiveBatchProbe):
    """Within: every ``torch.autograd.backward`` (``loss.backward()`` goes through it) that the
    strategy did not run is noted on ``probe`` as a ``plain`` backward, with the user's line."""
    import torch

    original = torch.autograd.backward

    def backward(*args, **kwargs):
        if not IN_STRATEGY["on"]:
            probe.note_backward("plain")
        return original(*args, **kwargs)

    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = original


# Whether a training step (forward, loss, backward) is under way: only its draws make the step's
# gradient random; the epoch's other hooks (a next epoch's dataset, a baseline rollout) do not.
IN_STEP = {"on": False}


def _make_callback(ns, probe: EffectiveBatchProbe):
    class Capture(ns.Callback):
        def setup(self, trainer, pl_module, stage):
            if stage == "fit":
                probe.setup(trainer)

        def on_train_start(self, trainer, pl_module):
            probe.train_start(pl_module, trainer)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            probe.batch_start(trainer, batch, batch_idx)
            IN_STEP["on"] = True

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            IN_STEP["on"] = False

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            probe.before_step(pl_module)

    return Capture()


def _keep_ddp_going(strategy) -> None:
    """A parameter without gradient under find_unused_parameters=False leaves its bucket
    unreduced, so ranks would step on different gradients: force the flag on (unless
    static_graph), as the shared fit does; the verdict is about loss scaling, not the flag."""
    ddp_kwargs = getattr(strategy, "_ddp_kwargs", None)
    if isinstance(ddp_kwargs, dict) and not ddp_kwargs.get("static_graph", False):
        ddp_kwargs["find_unused_parameters"] = True


def _one_step_kwargs(run: RankRun, user: dict, strategy, world_size: int, micro_batches: int) -> dict:
    kwargs = run.trainer_kwargs(strategy, {k: v for k, v in user.items() if k != "strategy"}, world_size)
    # One epoch up to the first optimizer step: the epoch's usual hooks (validation, on_fit_end)
    # still run as the user's code expects.
    kwargs.update(max_steps=-1, max_epochs=1, limit_train_batches=micro_batches)
    kwargs.pop("val_check_interval", None)
    return kwargs


def _world_value(state: dict, accumulate: int, manual: bool, model, rank: int, precision=None) -> dict:
    return {"sizes": state["sizes"], "precision": precision, "items": state.get("items"),
            "item_keys": state.get("item_keys"),
            "accumulate": accumulate, "norm": state.get("norm"),
            "stepped": bool(state.get("stepped")), "loader": state.get("loader"),
            "dropout_off": state.get("dropout_off", 0), "manual": manual,
            "grad_sig": state.get("grad_sig"), "backwards": state["backwards"], "scales": state["scales"],
            "backward_site": state.get("backward_site"), "last_backward": state.get("last_backward"),
            "sum_norm": state.get("sum_norm"),
            "after_backward_diff": state.get("after_backward_diff"), "merge_note": state.get("merge_note"),
            "batch_stats_off": sorted(set(state.get("batch_stats_off") or [])),
            "batch_coupled": sorted(set(state.get("batch_coupled") or [])),
            "batch_stats_n": state.get("batch_stats_n", 0),
            "loss_lines": _loss_lines(model) if rank == 0 else []}


def one_step(ctx, args: RunArgs) -> dict:
    """Every rank: the world's first optimizer step under ``args.strategy``, saved for the one-rank
    reference. Returns
    ``{"ebatch": {...}, "reference_args": [folder, world, window] (rank 0, after a step)}``."""
    import torch

    folder = os.path.dirname(ctx.job_dir)
    with rank_run(ctx, args, traced=False) as run:
        probe = next(p for p in run.probes.values() if isinstance(p, EffectiveBatchProbe))
        probe.folder, probe.rank = folder, ctx.rank
        objects = run.objects
        user = dict(objects.user_kwargs)
        accumulate = user.get("accumulate_grad_batches", 1)
        accumulate = accumulate if isinstance(accumulate, int) and accumulate > 0 else 1
        manual = not objects.model.automatic_optimization
        strategy = run.strategy(args.strategy, user.get("strategy"))
        _keep_ddp_going(strategy)
        limit = max(accumulate, MANUAL_LIMIT) if manual else accumulate
        trainer = run.build_trainer(_one_step_kwargs(run, user, strategy, ctx.world_size, limit))
        with plain_backwards(probe):
            trainer.fit(objects.model, datamodule=objects.datamodule)
        state = probe.state
        torch.save(state["batches"], os.path.join(folder, f"ebatch_batches_rank{ctx.rank}.pt"))
        out = {"ebatch": _world_value(state, accumulate, manual, objects.model, ctx.rank,
                                      precision=str(getattr(trainer, "precision", "") or "") or None)}
    if ctx.rank == 0 and state.get("stepped"):
        out["reference_args"] = [folder, ctx.world_size, len(state["sizes"])]
    return out


def _reference_batches(folder: str, world: int, micro: int) -> tuple[list | None, str, str | None]:
    """``(batches, how, reason)``: the merged micro-batches rank 0 built through the user's
    collate_fn ('collate'), else the ranks' batches concatenated field by field ('concat') when
    they are plain tensors of equal trailing shapes; else ``(None, '', reason)``."""
    import torch

    merged = os.path.join(folder, "ebatch_merged.pt")
    if os.path.exists(merged):
        return torch.load(merged, map_location="cpu", weights_only=False), "collate", None
    per_rank = [torch.load(os.path.join(folder, f"ebatch_batches_rank{r}.pt"), map_location="cpu",
                           weights_only=False) for r in range(world)]
    if min(len(b) for b in per_rank) < micro:
        return None, "", "a rank recorded fewer micro-batches than the window"
    for j in range(micro):
        why = window.concatenable([per_rank[r][j] for r in range(world)])
        if why:
            return None, "", why
    return [window.concat([per_rank[r][j] for r in range(world)]) for j in range(micro)], "concat", None


def _reference_kwargs(run: RankRun, strategy, micro: int) -> dict:
    """The reference's Trainer kwargs: the world's, with the user's whole validation (no sanity
    check): a callback that logs at a loader's last batch must see it, or a monitor of the user's
    raises for the plugin's bound, not for the user's code."""
    user = dict(run.objects.user_kwargs)
    kwargs = _one_step_kwargs(run, user, strategy, 1, micro)
    kwargs.update(limit_val_batches=user.get("limit_val_batches", 1.0), num_sanity_val_steps=0)
    return kwargs


def _fit_reference(run: RankRun, model, dm, batches: list, folder: str, seed: int) -> EffectiveBatchProbe:
    """One rank, the saved weights, one step on a copy of ``batches`` (a module may change its
    batch in place), every micro-batch seeded from ``seed``; ``dm``: a datamodule no fit has torn
    down yet (or None). A raise after the step is kept in ``probe.state["after_step"]``: the
    step's gradient was taken."""
    objects = run.objects
    probe = EffectiveBatchProbe(folder, seed=seed)
    strategy = run.strategy("ddp", None)
    _keep_ddp_going(strategy)
    trainer = run.build_trainer(_reference_kwargs(run, strategy, len(batches)),
                                callbacks=(_make_callback(objects.ns, probe),))
    # The same samples come from wherever the user's train_dataloader lives; the rest of the
    # datamodule (validation, setup) stays the user's.
    ns = run.target.namespace
    holder = dm if dm is not None and defines(dm, "train_dataloader", ns) else model
    # The user's loader is built where Lightning builds it (after the datamodule's setup).
    own = holder.train_dataloader if defines(holder, "train_dataloader", ns) else None
    mine = copy.deepcopy(batches)
    object.__setattr__(holder, "train_dataloader", lambda: _Replay(mine, own() if own else None))
    try:
        trainer.fit(model, datamodule=dm)
    except Exception as exc:
        if not probe.grads:
            raise
        probe.state["after_step"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    return probe


def reference(ctx, args: RunArgs, folder: str, world: int, micro: int) -> dict:
    """One rank, the same weights, one step on the world's window merged, made twice under two
    RNG seeds. Returns ``{"reference": {...}}`` (``not_judged`` set when no fair batch exists)."""
    import torch

    with rank_run(ctx, args, traced=False) as run:
        # Built first: the user's module must be imported before batches of its own classes are
        # unpickled, and draws made in __init__ are not the step's.
        run.objects  # noqa: B018
        batches, how, why = _reference_batches(folder, world, micro)
        if batches is None:
            return {"reference": {"not_judged": why, "stepped": False}}
        draws: list = []
        with window.watch_draws(draws, active=lambda: IN_STEP["on"]):
            first = _fit_reference(run, run.objects.model, run.objects.datamodule, batches, folder, seed=1)
        # A fresh datamodule too: the first fit tore its own down, and a user's run sets up each one once.
        second = _fit_reference(run, run.objects.new_model(), run.objects.new_datamodule(), batches, folder, seed=2)
    state = first.state
    out = {"norm": state.get("norm"), "sizes": state["sizes"], "stepped": bool(state.get("stepped")),
           "merged_by": how, "draws": draws, "after_step": state.get("after_step") or second.state.get("after_step"),
           "repeat_diff": _rel_diff(second.grads, first.grads) if second.grads and first.grads else None}
    if first.grads:
        world_grads = torch.load(os.path.join(folder, "ebatch_grads.pt"), map_location="cpu", weights_only=False)
        out.update(_grad_comparison(first.grads, world_grads), rel_diff=_rel_diff(world_grads, first.grads))
    return {"reference": out}
