"""effective-batch: what one optimizer step really averages over, and whether the gradient is
the same whatever the world size.

Seed section "Choose using measured memory": the effective batch is the local batch times the
world size times the accumulation, for full accumulation windows; a partial final window, token
masks and uneven ranks need their own accounting; linear learning-rate scaling is a hypothesis.

Checked in the "effective-batch" run (rank side: ``probe.py``): the world trains one optimizer
step (one full accumulation window) with each rank's micro-batches, the initial weights and the
averaged first-step gradient saved; then a one-rank reference run (the run spec's ``reference``)
loads the same weights and trains one step on the same samples, the ranks' micro-batches
concatenated (1 rank x batch world*b). With a mean-reduced loss the two gradients agree; a
sum-reduced loss under DDP's gradient averaging, or a per-rank normalisation by a local count,
changes them by a factor, which fails with the factor and the loss line. The effective batch, a
partial final window and an uneven last batch are reported (informational: they pass). Dropout is
switched off in both runs so that only the reduction is compared.
"""

from __future__ import annotations

import math

from ...harness import RunSpec
from ...sites import fmt_site
from ..base import Contract, Evidence, Run, Verdict
from .probe import EffectiveBatchProbe, _concat  # noqa: F401  (_concat: tests build batches with it)

TOLERANCE = 0.10  # relative gap between the two gradient norms that fails


_FIX = ("use a mean-reduced loss (reduction='mean'), or normalise by the global count (all-reduce the "
        "token/sample count and divide by it, times the world size to undo DDP's averaging); if the scale is "
        "intended, scale the learning rate on purpose and report the effective batch next to it.")


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


class EffectiveBatch(Contract):
    id = "effective-batch"
    title = "The effective batch is reported and the gradient does not depend on the world size"
    seed = "Choose using measured memory"
    run_spec = RunSpec("effective-batch", "pytest_ltconform.contracts.effective_batch.probe:one_step",
                       reference="pytest_ltconform.contracts.effective_batch.probe:reference")
    probe_class = EffectiveBatchProbe
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
        line_text = "; ".join(f"{ln['what']} at {fmt_site(ln)}" for ln in lines)
        summary = f"{measured}: {_factor(ratio, world)}" + (f" ({line_text})" if line_text else "") + f". {report}"
        evidence = [Evidence(f"first-step gradient norm {n_world:.4g} (averaged over {world} ranks, batch {local} "
                             f"each)", rank=None),
                    Evidence(f"first-step gradient norm {n_ref:.4g} on 1 rank, batch {world * (local or 0)}, same "
                             f"samples and weights", rank=None)]
        for ln in lines:
            evidence.append(Evidence(f"{ln['what']}: {ln['text']}", site=fmt_site(ln)))
        for name, r in (ref.get("per_param") or [])[:3]:
            evidence.append(Evidence(f"parameter {name}: gradient ratio {r:.3g}"))
        return self.verdict("failed", summary, evidence=evidence, fix=_FIX, category="silent", notes=notes)

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
