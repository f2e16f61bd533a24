"""effective-batch: what one optimizer step really averages over, and whether the gradient is
the same whatever the world size.

Seed section "Choose using measured memory": the effective batch is the local batch times the
world size times the accumulation, for full accumulation windows; a partial final window, token
masks and uneven ranks need their own accounting; linear learning-rate scaling is a hypothesis.

Checked in the "effective-batch" run (rank side: ``probe.py``): the world trains up to its first
optimizer step (one accumulation window; with manual optimization, the training_step calls before
the first ``optimizer.step``); a one-rank reference run (the run spec's ``reference``) loads the
same weights and trains one step on the same samples, 1 rank x batch world*b. With a mean-reduced
loss the two gradients agree; a sum-reduced loss under DDP's gradient averaging, or a per-rank
normalisation by a local count, changes them by a factor, which fails with the factor and the loss
line. Manual accumulation fails when the applied step is N times the gradient of the mean loss over
the window (no 1/N on the loss passed to manual_backward). The comparison is judged only when it is
fair, else the item is skipped as "not judged" with the premise that does not hold; but (a) ranks
holding different gradients at the step fails (DDP's all-reduce was bypassed: a plain loss.backward()
the strategy did not run, or a backward under no_sync, named with its line; the replicas drift), (b)
the reference step is a function of weights and samples (two RNG seeds give the same gradient), (c)
the merged batch can be built (through the user's dataset and collate_fn, else field by field for
plain tensors). The effective batch, a partial final window and an uneven last batch are reported
(informational: they pass).
Dropout modules are switched off and batch-statistics layers (BatchNorm*, not SyncBatchNorm) run in
eval mode in both runs, so that only the reduction is compared; a BatchNorm without running statistics
keeps coupling the samples of a batch, which is a premise that does not hold. The reference run
validates as the user's Trainer would (no plugin bound), and a raise after its step does not undo it.
"""

from __future__ import annotations

import math

from ...claims import claim
from ...outcomes import Outcome
from ...runs import RunSpec
from ...sites import fmt_site
from ..base import Contract, Evidence, Run, Verdict
from .probe import EffectiveBatchProbe

TOLERANCE = 0.10  # relative gap between the two gradient norms that fails
# A mean-reduced loss gives the same gradient both ways up to float32 rounding (~1e-6); a pass needs
# the gradients to agree, not only their norms (a norm within TOLERANCE may point elsewhere).
AGREE = 1e-3
SAME_GRAD = 1e-4  # relative gap between ranks' gradient norms that says DDP did not average them
REPEAT = 1e-5     # relative gap between two reference steps (two RNG seeds) that says the step draws
SCALE = 1e-6      # relative tolerance on a manual loss's constant factor (1 or 1/N)
# Unit roundoff of the half precisions a run may compute in (Lightning's names start with these):
# the same gradient computed over a differently split batch differs by several of these.
ROUNDOFF = {"bf16": 2.0 ** -8, "16": 2.0 ** -11}
HALF_UNITS = 10   # roundoffs of a half precision within which two gradients agree


_FIX = ("use a mean-reduced loss (reduction='mean'), or normalise by the global count (all-reduce the "
        "token/sample count and divide by it, times the world size to undo DDP's averaging); if the scale is "
        "intended, scale the learning rate on purpose and report the effective batch next to it.")
_MANUAL_FIX = ("divide each micro-batch's loss by the number of micro-batches in the window before "
               "manual_backward (self.manual_backward(loss / N), with the actual count for a partial last window), "
               "and report the effective batch as local batch x world size x N.")


def _close(value: float, reference: float) -> bool:
    return math.isclose(value, reference, rel_tol=0.05)


def _factor(ratio: float, world: int) -> str:
    """What a gradient ratio (world / one rank) says about the loss."""
    if _close(ratio, 1.0 / world):
        return (f"the gradient shrinks by the world size ({world}): the loss scales with the number of "
                f"samples on a rank (a sum-reduced loss) and DDP averages gradients over ranks")
    if _close(ratio, float(world)):
        return (f"the gradient grows with the world size ({world}): the loss or gradient is multiplied by the "
                f"world size, or gradients are summed rather than averaged")
    return (f"the gradient changes by a factor {ratio:.3g} that is not the world size: each rank normalises "
            f"by its own count (tokens, valid samples), so ranks are weighted unequally")


def not_finite_norms(infos: list, ref: dict | None) -> tuple[str, list] | None:
    """A premise of every comparison of gradients (across ranks, and with the 1-rank reference):
    the gradient norms are finite. (sentence, claims) naming where one is NaN or inf; None when none
    is. A NaN or inf compares nothing, so it is neither equal nor different."""
    values, where, first = {}, [], None
    for r, info in enumerate(infos):
        bad = [(n, g) for n, g in (info or {}).get("grad_sig") or [] if not math.isfinite(g)]
        if bad:
            values[f"rank {r}"] = bad[0][1]
            where.append(f"rank {r}")
            first = first or bad[0][0]
    for key, label in (("world_norm", "the world's step averaged over ranks"), ("norm", "the 1-rank reference")):
        v = (ref or {}).get(key)
        if v is not None and not math.isfinite(v):
            values[label] = v
            where.append(label)
    if not values:
        return None
    bad = list(values.values())
    word = "NaN" if all(math.isnan(v) for v in bad) else "inf" if not any(math.isnan(v) for v in bad) else "NaN/inf"
    param = f" (parameter {first} first)" if first else ""
    text = (f"the first-step gradient is not judged, because the value is {word} on {' and on '.join(where)}"
            f"{param}, so no gradient norm can be compared across ranks or with the 1-rank step")
    return text, [claim("not-finite", text, values=values)]


def unaveraged(infos: list) -> str | None:
    """Premise (a): what shows that the ranks stepped on different gradients (so DDP did not
    average them), from each rank's ``grad_sig`` ([(parameter, gradient norm), ...]); None when
    every rank holds the same gradient or a rank recorded none."""
    sigs = [(info or {}).get("grad_sig") for info in infos]
    if len(sigs) < 2 or any(s is None for s in sigs):
        return None
    base = dict(sigs[0])
    for rank, sig in enumerate(sigs[1:], 1):
        other = dict(sig)
        if set(other) != set(base):
            names = sorted(set(base) ^ set(other))
            return (f"rank 0 and rank {rank} hold gradients for different parameters "
                    f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
        for name, norm in base.items():
            if not math.isclose(norm, other[name], rel_tol=SAME_GRAD, abs_tol=1e-9):
                return f"parameter {name} has gradient norm {norm:.6g} on rank 0 and {other[name]:.6g} on rank {rank}"
    return None


def _rank_norms(infos: list) -> list[tuple[int, float]]:
    """Each rank's gradient norm over its recorded gradient signature."""
    return [(rank, math.sqrt(sum(n * n for _, n in (info or {}).get("grad_sig") or [])))
            for rank, info in enumerate(infos)]


def drawn_at(ref: dict) -> str:
    """Where the reference step drew random numbers in user code, for a one-line reason."""
    draws = ref.get("draws") or []
    if not draws:
        return ""
    shown = "; ".join(f"{d['what']} at {fmt_site(d)}" for d in draws[:2])
    return f" ({shown})"


class EffectiveBatch(Contract):
    id = "effective-batch"
    needs_finite_loss = True
    title = "The effective batch is reported and the gradient does not depend on the world size"
    rule_section = "Choose using measured memory"
    run_spec = RunSpec("effective-batch", "pytest_ltconform.contracts.effective_batch.probe:one_step",
                       reference="pytest_ltconform.contracts.effective_batch.probe:reference",
                       what="the plugin's effective-batch replay (one optimizer step on every rank, then the same "
                            "samples in one batch on one rank)")
    probe_class = EffectiveBatchProbe
    strategies = ("ddp",)
    tiers = ("cpu",)  # the one-rank reference run exists on the local CPU tier only

    def judge(self, run: Run) -> Verdict:
        infos = [(v or {}).get("ebatch") for v in run.values()]
        info = infos[0]
        if not info:
            return self.verdict(Outcome.ERROR, "the one-step run returned nothing", diagnosis=run.job.failure_text())
        world = run.world_size
        local = _local(info)
        window = len(info["sizes"]) if info.get("manual") else info["accumulate"]
        report, notes = self._report(infos, local, world, window)
        if not info.get("stepped"):
            return self.not_judged(f"no optimizer step was taken in the first "
                                f"{len(info['sizes'])} training batches, so there is no step to compare. {report}",
                                notes=notes)
        ref_run = run.reference
        ref = (ref_run.value(0) or {}).get("reference") if ref_run is not None and ref_run.finished else None
        unfinite = not_finite_norms(infos, ref)
        if unfinite:
            return self.not_judged(f"{unfinite[0]}. {report}", notes=notes, claims=unfinite[1])
        spread = unaveraged(infos)
        if spread:
            return self._unsynced(infos, spread, report, notes)
        premise = self._premise(infos, ref)
        if premise:
            return self.not_judged(f"{premise}. {report}", notes=notes)
        if not ref or not ref.get("stepped") or ref.get("norm") is None:
            # A premise too: the merged batch must be one the module accepts (a model built for a
            # fixed number of series or a fixed width refuses a batch of world x local samples).
            return self.not_judged(f"the plugin's one-rank reference run took no step on the "
                                           f"ranks' samples merged into one batch ({_reference_failure(ref_run)}); "
                                           f"a failure of the plugin's own run, not a finding. {report}", notes=notes)
        if ref.get("merged_by") == "concat" and info.get("merge_note"):
            notes.append(f"the ranks' batches were concatenated field by field for the 1-rank step: "
                         f"{info['merge_note']}.")
        if info.get("dropout_off"):
            notes.append(f"{info['dropout_off']} dropout module(s) were switched off in both runs for the comparison.")
        notes.extend(_plugin_run_notes(info, ref))
        verdict = self._world_size(info, infos, ref, world, local, report, notes)
        if any("couples the samples of a batch" in n for n in verdict.notes) and \
                not any(c.kind == "coupling" for c in verdict.claims):
            verdict.claims.append(_coupling_claim(ref, info.get("precision")))  # the note on the direction
        return verdict

    @staticmethod
    def _premise(infos: list, ref: dict | None) -> str | None:
        """The premise of a fair comparison that does not hold, in one line; None when all hold."""
        coupled = (infos[0] or {}).get("batch_coupled")
        if coupled:
            return (f"{', '.join(coupled)} normalises each sample by the statistics of its own batch even in eval "
                    f"mode, so a sample's output depends on the other samples of its batch and 2 ranks x b and 1 rank "
                    f"x {len(infos)}b compute different functions; their gradients cannot be compared")
        if ref and ref.get("not_judged"):
            note = (infos[0] or {}).get("merge_note")
            return (f"the ranks' first-window samples cannot be merged into one batch for the 1-rank step: "
                    f"{note + '; field by field: ' if note else ''}{ref['not_judged']}; so whether the step's "
                    f"gradient depends on the world size (a loss summed over the batch rather than averaged) was "
                    f"not established{_unchecked_sums(infos[0])}")
        repeat = (ref or {}).get("repeat_diff")
        if repeat is not None and repeat > REPEAT:
            return (f"the gradient depends on random draws inside the step{drawn_at(ref)}: the same weights and "
                    f"samples gave gradients {repeat:.2g} apart (relative) under two seeds, so a 1-rank step cannot "
                    f"reproduce the ranks' own gradients")
        return None

    def _unsynced(self, infos: list, spread: str, report: str, notes: list) -> Verdict:
        """The ranks stepped on different gradients: DDP's all-reduce was bypassed, so the replicas
        drift apart from the first step. Names the last backward before the step where recorded: a
        ``loss.backward()`` the strategy did not run, or a backward with DDP's sync off (no_sync)."""
        last = [(info or {}).get("last_backward") or {} for info in infos]
        kinds = {b.get("kind") for b in last}
        site = next((b["site"] for b in last if b.get("site") and b.get("kind") != "synced"), None)
        where = f" at {fmt_site(site)}" if site else ""
        if "plain" in kinds:
            cause = (f"the last backward before the step{where} is a plain loss.backward(), not run by the strategy, "
                     f"so DDP's reducer was not armed and nothing all-reduced the gradients")
            fix = ("call self.manual_backward(loss) instead of loss.backward() under manual optimization (it runs "
                   "the backward through the strategy, which all-reduces the gradients under DDP).")
        elif "no_sync" in kinds:
            cause = (f"the last backward before the step{where} ran with DDP's gradient sync off (no_sync), so "
                     f"nothing all-reduced the gradients")
            fix = ("run the last backward of each accumulation window outside no_sync (self.manual_backward(loss) "
                   "with the sync on), so that the step's gradient is all-reduced.")
        else:
            cause = "no recorded backward explains it (every backward before the step went through DDP's reducer)"
            fix = ("let every backward go through self.manual_backward / the strategy and do not change the "
                   "gradients per rank between the backward and optimizer.step.")
        summary = (f"the ranks stepped on different gradients at the first optimizer step ({spread}): {cause}; the "
                   f"replicas' weights drift apart from this step on, silently. {report}")
        evidence = [Evidence(f"gradient norm {norm:.6g} at the first optimizer step", rank=rank)
                    for rank, norm in _rank_norms(infos)]
        if site:
            what = "loss.backward()" if "plain" in kinds else "backward under no_sync"
            evidence.append(Evidence(f"last backward before the step: {what}", site=fmt_site(site)))
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=fix, category="silent", notes=notes)

    def _world_size(self, info: dict, infos: list, ref: dict, world: int, local, report: str,
                    notes: list) -> Verdict:
        n_world, n_ref = ref["world_norm"], ref["norm"]
        ratio = n_world / n_ref if n_ref else float("inf")
        cos = ref.get("cosine")
        samples = _samples(infos)
        batches = (f"{world} ranks x batch {local} vs {n_ref:.4g} on 1 rank x batch {world * local}" if local
                   else f"{world} ranks vs {n_ref:.4g} on 1 rank with the ranks' batches merged")
        measured = (f"first-step gradient norm {n_world:.4g} on {batches}, same {samples or 'samples'} and weights "
                    f"(ratio {ratio:.3g}" + (f", cosine {cos:.4f}" if cos is not None else "") + ")")
        if cos is not None and cos < 0.99:
            notes.append(f"the gradient direction differs too (cosine {cos:.3f}): a loss or layer that couples the "
                         f"samples of a batch (a contrastive loss, batch statistics) or per-rank weighting make the "
                         f"step depend on how samples are split.")
        if abs(ratio - 1.0) <= TOLERANCE:
            precision = info.get("precision")
            gap = _disagreement(ref, cos, precision)
            if gap:
                return self.not_judged(f"the world's and the 1-rank gradients differ beyond "
                                    f"{_rounding_words(precision)} ({gap}) but not by a factor ({measured}): a loss or "
                                    f"layer that couples the samples of a batch (a contrastive loss over in-batch "
                                    f"negatives) or a per-rank normalisation by nearly equal counts would both do "
                                    f"this, and one step cannot tell them apart. {report}", notes=notes,
                                       claims=[_coupling_claim(ref, precision)])
            rounded = _disagreement(ref, cos)
            if rounded:  # beyond float32 rounding, within the half precision's own
                notes.append(f"the world's and the 1-rank gradients differ by {rounded.split(' > ')[0]}, within what "
                             f"{_rounding_words(precision)} gives: the run computed in {precision}.")
            manual = self._manual_window(info, world, samples, report, notes)
            return manual or self.verdict(Outcome.PASSED, f"{report} The {measured}: world-size invariant.",
                                          notes=notes)
        lines = info.get("loss_lines") or []
        coupled = self._coupled_not_counted(ratio, world, cos, lines, measured, report, notes)
        if coupled is not None:
            return coupled
        line_text = "; ".join(f"{ln['what']} at {fmt_site(ln)}" for ln in lines)
        summary = f"{measured}: {_factor(ratio, world)}" + (f" ({line_text})" if line_text else "") + f". {report}"
        each = f", batch {local} each" if local else ""
        merged = f"batch {world * local}" if local else "the ranks' batches merged"
        evidence = [Evidence(f"first-step gradient norm {n_world:.4g} (averaged over {world} ranks{each})", rank=None),
                    Evidence(f"first-step gradient norm {n_ref:.4g} on 1 rank, {merged}, same samples and weights",
                             rank=None)]
        for ln in lines:
            evidence.append(Evidence(f"{ln['what']}: {ln['text']}", site=fmt_site(ln)))
        for name, r in (ref.get("per_param") or [])[:3]:
            evidence.append(Evidence(f"parameter {name}: gradient ratio {r:.3g}"))
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=_FIX, category="silent", notes=notes)

    def _coupled_not_counted(self, ratio: float, world: int, cos, lines: list, measured: str, report: str,
                             notes: list) -> Verdict | None:
        """A factor that is not the world size with the direction changed too, and no loss line
        that divides by a local count: samples coupled within a batch (a contrastive loss over
        in-batch negatives) do the same, and one step cannot tell them apart, so not judged. None
        when the verdict stands (a world-size factor, the same direction, or a local-count line)."""
        if _close(ratio, 1.0 / world) or _close(ratio, float(world)) or cos is None or cos >= 0.99:
            return None
        if any(ln.get("what", "").startswith(("divides", "averages")) for ln in lines):
            return None
        return self.not_judged(f"the gradient changes by a factor that is not the world size and "
                            f"its direction differs ({measured}), but no loss line divides by a count of its own "
                            f"batch: a loss or layer that couples the samples of a batch (a contrastive loss over "
                            f"in-batch negatives) would do the same, and one step cannot tell them apart. {report}",
                            notes=notes, claims=[_coupling_claim({"rel_diff": abs(ratio - 1.0)}, None)])

    def _manual_window(self, info: dict, world: int, samples: str | None, report: str, notes: list) -> Verdict | None:
        """Manual optimization over N >= 2 micro-batches: the applied step against the gradient of
        the mean loss over the window. Each micro-batch's gradient is what its manual_backward
        added; the loss passed in is the micro-batch's loss times the constant factors at the root
        of its graph (1/N when divided by N). None when the window passes."""
        n = len(info["sizes"])
        if not info.get("manual") or n < 2:
            return None
        counts, scales = info.get("backwards") or [], info.get("scales") or []
        site = info.get("backward_site")
        where = f" at {fmt_site(site)}" if site else ""
        if len(counts) != n or any(c != 1 for c in counts):
            return self.not_judged(f"manual optimization over {n} micro-batches called "
                                f"manual_backward {counts} times per training_step, so the step cannot be split into "
                                f"one loss per micro-batch. {report}", notes=notes)
        diff = info.get("after_backward_diff")
        if diff is None or diff > SAME_GRAD:
            return self.not_judged("the gradients changed between the last manual_backward and "
                                "optimizer.step (clipped or rescaled by hand), so the applied step is not the sum of "
                                f"the micro-batch gradients. {report}", notes=notes)
        if any(c is None or not math.isclose(c, scales[0], rel_tol=SCALE) for c in scales):
            return self.not_judged(f"the losses passed to manual_backward{where} carry "
                                f"different constant factors ({scales}). {report}", notes=notes)
        scale = scales[0]
        if math.isclose(scale * n, 1.0, rel_tol=SCALE):
            notes.append(f"manual accumulation over N={n} micro-batches divides each loss by N{where}.")
            return None
        if not math.isclose(scale, 1.0, rel_tol=SCALE):
            return self.not_judged(f"manual accumulation over N={n} micro-batches, and the loss "
                                f"passed to manual_backward{where} is scaled by {scale:.4g}, not 1/N: a divisor for "
                                f"the window cannot be told from a loss weight. {report}", notes=notes)
        applied, mean_grad = info["norm"], (info.get("sum_norm") or 0.0) / n
        ratio = applied / mean_grad if mean_grad else float("inf")
        summary = (f"first optimizer step's gradient is {ratio:.3g}x the gradient of the mean loss over the same {n} "
                   f"micro-batches x {world} ranks{f' ({samples})' if samples else ''}: manual accumulation over "
                   f"N={n} without "
                   f"dividing the loss by N (the loss passed to manual_backward{where} carries no 1/N factor). "
                   f"{report}")
        evidence = [Evidence(f"gradient norm {applied:.4g} at the first optimizer.step: the sum of {n} micro-batch "
                             f"gradients, each averaged over {world} ranks"),
                    Evidence(f"gradient norm {mean_grad:.4g} of the mean loss over the window (the mean of the {n} "
                             f"micro-batch gradients)"),
                    Evidence(f"manual_backward(loss) on each of the {n} micro-batches, loss not divided by {n}",
                             site=fmt_site(site) if site else None)]
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=_MANUAL_FIX, category="silent", notes=notes)

    @staticmethod
    def _report(values: list, local, world: int, acc: int) -> tuple[str, list[str]]:
        loaders = [(v or {}).get("loader") or {} for v in values]
        if local:
            report = (f"Effective batch {local * world * acc} = {local} (per rank) x {world} (ranks) x {acc} "
                      f"(accumulation) for full windows.")
        else:
            kind = loaders[0].get("type") if loaders and loaders[0].get("type") else "the train loader"
            report = (f"Effective batch not counted: the dataset items in a batch of {kind} cannot be counted (no "
                      f"dataset keys to read and no batch_size), and tensor rows are not samples; {world} (ranks) x "
                      f"{acc} (accumulation) batches per optimizer step.")
        notes = []
        batches = [ld.get("batches") for ld in loaders]
        samples = [ld.get("samples") for ld in loaders]
        bs = loaders[0].get("batch_size") if loaders else None
        if batches[0] and acc > 1 and batches[0] % acc:
            rest = batches[0] % acc
            notes.append(f"partial final window: an epoch has {batches[0]} batches per rank, so its last optimizer "
                         f"step averages {rest} of {acc} micro-batches"
                         + (f" (effective batch {local * world * rest} there)." if local else "."))
        if bs and samples[0] and not loaders[0].get("drop_last") and samples[0] % bs:
            last = samples[0] % bs
            notes.append(f"uneven last batch: {samples[0]} samples per rank with batch size {bs} leave a last batch of "
                         f"{last} per rank (drop_last=False), so that step averages {last * world} samples.")
        if len({b for b in batches if b is not None}) > 1:
            notes.append("ranks have different numbers of batches per epoch: "
                         + ", ".join(f"rank {r}: {b}" for r, b in enumerate(batches)))
        return report, notes


CONTRACT = EffectiveBatch()


def _unchecked_sums(info: dict | None) -> str:
    """The loss lines that sum over the batch, named in a "not judged" reason: what a reader should
    check by hand, not a finding."""
    lines = [ln for ln in (info or {}).get("loss_lines") or []
             if not ln.get("what", "").startswith(("divides", "averages"))]
    if not lines:
        return ""
    shown = "; ".join(f"`{ln['text']}` at {fmt_site(ln)}" for ln in lines[:2])
    return f" (unchecked: the loss code sums over the batch: {shown})"


def _local(info: dict) -> int | None:
    """Dataset items in a rank's first batch: the keys its fetch handed the dataset, else the
    DataLoader's batch_size (one item per slot); None when neither is known (tensor rows are not
    items: a collated graph has atoms, a padded batch has rows per sequence)."""
    items = info.get("items")
    if items:
        return items[0]
    return (info.get("loader") or {}).get("batch_size") or None


def _samples(infos: list) -> str | None:
    """The window's samples on all ranks together, as the dataset handed them out; None when
    they could not be counted."""
    if not all((v or {}).get("items") for v in infos):
        return None
    total = sum(sum(v["items"]) for v in infos)
    distinct = len({k for v in infos for k in (v.get("item_keys") or [])})
    if distinct and distinct < total:
        return f"{total} samples ({distinct} distinct: ranks drew the same samples)"
    return f"{total} samples"


def _coupling_claim(ref: dict, precision: str | None):
    """The claim behind "a loss or layer that couples the samples of a batch": the gap measured and
    the rounding limit of the precision the run computed in (claims kind "coupling")."""
    from ...claims import claim

    return claim("coupling", "a loss or layer that couples the samples of a batch", rel_diff=ref.get("rel_diff"),
                 limit=_agree_limit(precision), precision=precision or "32-true")


def _agree_limit(precision: str | None) -> float:
    """The relative gap within which two gradients agree: float32 rounding (AGREE), or HALF_UNITS
    roundoffs of the half precision the run computed in (``precision``: Lightning's name)."""
    half = next((k for k in ROUNDOFF if str(precision or "").startswith(k)), None)
    return max(AGREE, HALF_UNITS * ROUNDOFF[half]) if half else AGREE


def _rounding_words(precision: str | None) -> str:
    limit = _agree_limit(precision)
    if limit == AGREE:
        return "float32 rounding"
    return f"{precision} rounding ({HALF_UNITS} x its unit roundoff, {limit:.2g})"


def _disagreement(ref: dict, cos: float | None, precision: str | None = None) -> str | None:
    """How the two gradients differ beyond the rounding of ``precision`` (float32 when None), or
    None when they agree."""
    limit = _agree_limit(precision)
    rel = ref.get("rel_diff")
    if rel is not None:
        return f"relative difference {rel:.2g} > {limit:.2g}" if rel > limit else None
    return f"cosine {cos:.4f}" if cos is not None and cos < 1 - limit else None


def _plugin_run_notes(info: dict, ref: dict) -> list[str]:
    """What the plugin's own step runs did differently from the user's training, in notes."""
    notes = []
    if info.get("batch_stats_off"):
        count = f"{info['batch_stats_n']} " if info.get("batch_stats_n") else ""
        notes.append(f"{count}batch-statistics layer(s) ({', '.join(info['batch_stats_off'])}) ran in eval mode "
                     f"(running statistics) in both runs: in training mode they normalise by each rank's own batch, "
                     f"which differs between world x b and 1 x world*b whatever the loss; the user's training is "
                     f"unchanged.")
    if ref.get("after_step"):
        notes.append(f"the plugin's one-rank reference run raised after its step ({ref['after_step']}); the step's "
                     f"gradient was taken before, so the comparison stands.")
    return notes


def _reference_failure(ref_run) -> str:
    """Why the one-rank reference did not step, in one line: its exception at the user's line."""
    from ...world.causes import first_cause

    if ref_run is None:
        return "no reference run: the world did not save its step"
    cause = first_cause(ref_run.job)
    return cause.headline() if cause is not None else "it took no optimizer step"
