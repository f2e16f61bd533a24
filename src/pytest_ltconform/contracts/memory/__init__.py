"""memory: a strategy is chosen on measured memory, per device, not on a parameter count.

Rules section "Choose using measured memory": DDP fits when a whole replica (weights, gradients,
optimizer state) plus the peak activations fits on each device; FSDP and DeepSpeed ZeRO shard
that state; precision, optimizer, sequence length and batch size decide, not a parameter cutoff.

Judged on the traced fit (rank side: ``probe.py``). Each item shows, per rank of the run it
judges, the bytes of parameters, gradients and optimizer state that rank held (each storage once)
and the activations one training step saved for backward; and, from a child process rank 0 forks
for it alone (``apart.py``), the production step traced under fake tensors (``predict.py``) at the
Trainer config's devices x num_nodes, precision and the loader's batch size, per strategy
(``plan.py``). With a device size
(``--ltconform-device-memory``, or the GPU's own on a CUDA rank), the item of the configured
strategy fails when its per-device peak does not fit, naming the strategies that would; without
one, every item is advisory: the table only.
"""

from __future__ import annotations

import dataclasses

from ...outcomes import Outcome
from ...sites import no_addresses
from ..base import Contract, Evidence, Run, Verdict
from .plan import CANDIDATES, SHARDING, fits, per_device, row_text, size
from .probe import MemoryProbe

_LABELS = {"ddp": "DDP", "fsdp": "FSDP", "deepspeed": "DeepSpeed"}


@dataclasses.dataclass
class MemoryVerdict(Verdict):
    """A verdict that carries the memory table into the JSON report (``table``)."""

    table: dict | None = None

    def as_dict(self) -> dict:
        return {**super().as_dict(), "table": self.table}


def _with_table(verdict: Verdict, table: dict) -> MemoryVerdict:
    fields = {f.name: getattr(verdict, f.name) for f in dataclasses.fields(Verdict)}
    return MemoryVerdict(**fields, table=table)


class Memory(Contract):
    id = "memory"
    title = "The configured strategy's step fits the device, measured per rank"
    rule_section = "Choose using measured memory"
    probe_class = MemoryProbe
    strategies = ("ddp", "fsdp", "deepspeed")

    def judge(self, run: Run) -> Verdict:
        observed = run.probe(self.id)
        ranks = {r: o for r, o in enumerate(observed) if isinstance(o, dict)}
        if not ranks:
            return self.not_judged("no rank of the fit returned its memory figures "
                                           "(the run did not reach its end on any rank).")
        if not any(o.get("batches") for o in ranks.values()):
            return self.not_judged("no training batch ran, so nothing was measured.",
                                empty=True)
        measured = _measured(ranks)
        prediction = (ranks.get(0) or {}).get("prediction") or {"error": "rank 0 returned no prediction"}
        capacity, source = _capacity(run, ranks)
        table = {"measured": measured, "predicted": _predicted_table(prediction), "capacity": capacity,
                 "capacity_from": source}
        evidence = [Evidence(_measured_text(row), rank=r) for r, row in measured["ranks"].items()]
        notes = _notes(ranks, prediction)
        verdict = self._decide(run, measured, prediction, capacity, source, evidence, notes)
        # A rank's error text may carry a repr's address (<... at 0x7f...>): a name says it, not that.
        verdict.notes = [no_addresses(n) for n in verdict.notes]
        verdict.summary = no_addresses(verdict.summary)
        return _with_table(verdict, table)

    def _decide(self, run, measured, prediction, capacity, source, evidence, notes) -> Verdict:
        mine = _item_label(run.strategy, measured)
        if "error" in prediction:
            return self._measured_only(mine, measured, prediction, capacity, source, evidence, notes)
        world = prediction["world"]
        configured = prediction["configured"]
        rows = {label: per_device(label, prediction, world)
                for label in dict.fromkeys((configured, mine, *CANDIDATES)) if label in SHARDING}
        evidence += [Evidence(f"production step (predicted): {row_text(label, row, world)}"
                              + (" (configured)" if label == configured else ""))
                     for label, row in rows.items()]
        setting = _production_setting(prediction)
        if capacity is None:
            return self.verdict(Outcome.ADVISORY, _advisory(mine, measured, rows, configured, world, setting),
                                evidence=evidence, notes=notes)
        need = rows[configured]["total"]
        judged_here = _kind(configured) == run.strategy
        if prediction.get("offload") and judged_here:
            return self.not_judged(f"{prediction['offload']}, which this count of device memory "
                                           f"does not model; {row_text(configured, rows[configured], world)} without "
                                           f"offloading.", evidence=evidence, notes=notes)
        if need <= capacity:
            summary = (f"{configured} on {world} devices fits {size(capacity)} ({source}) for {setting}: "
                       f"{size(need)} per device, {size(capacity - need)} headroom.")
        else:
            others = [row_text(label, row, world) for label, row in fits(prediction, world, capacity)]
            step = prediction["activations"] + prediction.get("temporaries", 0)
            would = f"Strategies that would fit: {'; '.join(others)}." if others else \
                "No strategy here fits on that many devices: the activations and temporaries alone need " \
                f"{size(step)}; lower the batch or sequence length, or add activation checkpointing."
            summary = (f"{configured} on {world} devices needs {size(need)} per device for {setting}, more than "
                       f"the {size(capacity)} stated ({source}). {would}")
        if not judged_here:  # only the configured strategy's item gives a verdict, either way
            return self.verdict(Outcome.ADVISORY, f"(the [{_kind(configured)}] item judges the configured "
                                                  f"strategy) {summary}", evidence=evidence, notes=notes)
        if need <= capacity:
            return self.verdict(Outcome.PASSED, summary, evidence=evidence, notes=notes)
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, notes=notes, fix=_fix(others, configured))

    def _measured_only(self, mine, measured, prediction, capacity, source, evidence, notes) -> Verdict:
        peak = max(row["total"] for row in measured["ranks"].values())
        why = f"the production step was not traced, because {prediction['error']}; these are the figures of " \
              "this small run"
        notes.append(why)
        configured = measured.get("configured") or "DDP"
        if capacity is not None and _kind(configured) != _kind(mine):
            # only the configured strategy's item is judged against the device
            return self.verdict(Outcome.ADVISORY, f"{mine} on this run: up to {size(peak)} per rank (measured; {why}); "
                                                  f"the [{_kind(configured)}] item judges the configured {configured} "
                                                  f"against the {size(capacity)} stated ({source}).",
                                evidence=evidence, notes=notes)
        if capacity is not None and measured.get("offload"):
            return self.not_judged(f"{measured['offload']}, which this count of device memory "
                                           f"does not model.", evidence=evidence, notes=notes)
        if capacity is None:
            return self.verdict(Outcome.ADVISORY, f"{mine} on this run: up to {size(peak)} per rank (measured; {why}); "
                                                  f"no device size is stated (--ltconform-device-memory).",
                                evidence=evidence, notes=notes)
        if peak <= capacity:
            return self.verdict(Outcome.PASSED, f"{mine} fits {size(capacity)} ({source}) on this small run: "
                                                f"{size(peak)} per rank, measured, not predicted at production size.",
                                evidence=evidence, notes=notes)
        return self.verdict(Outcome.FAILED, f"{mine} needs {size(peak)} per rank on this small run, more than the "
                                            f"{size(capacity)} stated ({source}) (measured, not predicted).",
                            evidence=evidence, notes=notes, fix=_fix([], mine))


def _advisory(mine: str, measured: dict, rows: dict, configured: str, world: int, setting: str) -> str:
    """The item's own strategy, measured on this run and predicted at production size, then the
    configured one when it is another."""
    peak = max(row["total"] for row in measured["ranks"].values())
    text = f"{mine} held up to {size(peak)} per rank on this run (measured); predicted for {setting}: "
    text += row_text(mine, rows[mine], world) if mine in rows else "not modelled for this strategy"
    if mine != configured:
        text += f"; the configured {configured}: {size(rows[configured]['total'])} per device"
    return text + ". No device size is stated, so nothing is judged (--ltconform-device-memory)."


def _kind(label: str) -> str:
    return "fsdp" if label.startswith("FSDP") else "deepspeed" if label.startswith("DeepSpeed") else "ddp"


def _item_label(strategy: str, measured: dict) -> str:
    labels = {row.get("strategy") for row in measured["ranks"].values()} - {None}
    return labels.pop() if len(labels) == 1 else _LABELS.get(strategy, strategy)


def _measured(ranks: dict) -> dict:
    rows = {}
    for r, obs in sorted(ranks.items()):
        b = obs.get("bytes") or {}
        row = {k: int(b.get(k, 0)) for k in ("params", "grads", "optimizer", "activations")}
        row["total"] = sum(row.values())
        row.update(strategy=obs.get("strategy"), world_size=obs.get("world_size"), precision=obs.get("precision"),
                   batches=obs.get("batches"), storages=obs.get("storages"))
        if "cuda_peak" in obs:
            row["cuda_peak"] = obs["cuda_peak"]
        rows[r] = row
    first = ranks[min(ranks)]
    return {"kind": "measured", "ranks": rows, "configured": first.get("configured"), "offload": first.get("offload")}


def _measured_text(row: dict) -> str:
    text = (f"measured, {row['strategy']} on {row['world_size']} ranks ({row['precision']}): params "
            f"{size(row['params'])}, grads {size(row['grads'])}, optimizer {size(row['optimizer'])}, activations "
            f"{size(row['activations'])} (saved for backward); {size(row['total'])} in all")
    if "cuda_peak" in row:
        text += f"; torch.cuda.max_memory_allocated {size(row['cuda_peak'])}"
    return text


def _predicted_table(prediction: dict) -> dict:
    if "error" in prediction:
        return {"kind": "predicted", "error": prediction["error"]}
    world = prediction["world"]
    return {"kind": "predicted", "world": world, "batch": prediction["batch"], "precision": prediction["precision"],
            "configured": prediction["configured"], "unsharded": prediction["bytes"],
            "activations": prediction["activations"], "temporaries": prediction.get("temporaries", 0),
            "peak_traced": prediction["peak"],
            "strategies": {label: per_device(label, prediction, world)
                           for label in dict.fromkeys((prediction["configured"], *CANDIDATES))}}


def _production_setting(prediction: dict) -> str:
    opt = "/".join(prediction.get("optimizers") or []) or "no optimizer"
    return (f"{prediction['world']} devices, precision {prediction['precision']}, {opt}, batch "
            f"{prediction['batch']} per device")


def _capacity(run: Run, ranks: dict) -> tuple[int | None, str | None]:
    """The device size to judge against: the stated one first, else a CUDA rank's own capacity."""
    stated = getattr(getattr(run, "settings", None), "device_memory", None)
    if stated:
        return int(stated), getattr(run.settings, "device_memory_from", None) or "--ltconform-device-memory"
    totals = [o["device_total"] for o in ranks.values() if o.get("device_total")]
    return (min(totals), "the GPU's own capacity, torch.cuda") if totals else (None, None)


def _notes(ranks: dict, prediction: dict) -> list[str]:
    notes = []
    errors = sorted({e for o in ranks.values() for e in o.get("errors") or ()})
    if errors:
        notes.append(f"some tensors could not be read on a rank: {'; '.join(errors[:2])}")
    if prediction.get("world_note"):
        notes.append(f"devices: {prediction['world_note']}, so the run's world size was used")
    if prediction.get("drawn") and prediction.get("batch") and prediction["drawn"] != prediction["batch"]:
        notes.append(f"the loader's first batch had {prediction['drawn']} samples; the prediction uses its "
                     f"stated batch_size={prediction['batch']}")
    notes.append("not counted: the allocator's caching and fragmentation, communication buckets and buffers, "
                 "CUDA context and kernels' workspaces")
    return notes


def _fix(others: list[str], configured: str) -> str:
    if others:
        return (f"choose a strategy that fits (first: {others[0].split(':')[0]}), or lower the per-device batch or "
                f"precision; re-run with the same --ltconform-device-memory to check.")
    return f"lower the per-device batch, sequence length or precision under {configured}, or add devices."


CONTRACT = Memory()
