"""device-placement: tensors, devices and collectives are placed as NCCL ranks on GPUs need them.

Seed section "Choose using measured memory": NCCL is the usual CUDA backend, gloo the CPU one.
What NCCL ranks need that gloo ranks do not (the table is on the rule page,
``contract_docs/device-placement.md``): every tensor a collective gets on the rank's own GPU, that
GPU current before object collectives and new groups run, one GPU per process. On CPU ranks every
tensor is on the CPU and gloo takes them all, so none of these faults shows; they are the errors
users meet first on GPU runners.

Judged on CPU ranks from the traced fit the other contracts share. The interception
(``cuda_on_cpu``) runs code that names CUDA on the rank's CPU and records each device it asks for;
the probe follows the device each tensor would have on GPU ranks (``follow.py``) and records the
tensors collectives get, calls that mix devices, ``.numpy()`` of device tensors, object
collectives before the device is set, plain tensor attributes and ``torch.load`` calls. The
verdict weighs each finding against the user's Trainer config (``config.py``): a fault that breaks
the configured GPU run fails with the user's line per rank and what GPU ranks would raise; where
the config is CPU-only, or the fault needs more GPUs or nodes than it asks for, it is an advisory.
A static pass over the user's files adds the sites the run did not reach, marked so, never failing.
On the GPU tier the same probe reads the real devices and a rank's device error is this contract's.
"""

from __future__ import annotations

from ...claims import Claim, claim
from ...cuda_on_cpu import EV_CUDA, EV_LOAD, EV_UNMAPPED
from ...events import CALL, HOOK
from ...outcomes import Outcome
from ...sites import fmt_site, plural
from ...target.loading import trainer_file
from ..base import Blame, Contract, Evidence, Run, Verdict, user_classes
from . import findings as kinds
from .config import Production
from .probe import EV_LOADED, DevicePlacementProbe
from .source import static_sites

# What GPU ranks raise for a device fault, as the GPU tier sees it.
GPU_ERRORS = (kinds.NO_BACKEND, "Tensors must be CUDA and dense", "Expected all tensors to be on the same device",
              "Duplicate GPU detected", "invalid device ordinal", "can't convert cuda", kinds.REINIT)


def _config(run: Run) -> tuple[dict | None, str]:
    """The Trainer config's facts and the world ('cpu' or 'gpu') from the first rank that built its objects."""
    for r in range(run.world_size):
        event = next(iter(run.events(r, EV_LOADED)), None)
        if event is not None:
            return event.get("config"), event.get("world", "cpu")
    return None, "cpu"


class DevicePlacement(Contract):
    id = "device-placement"
    title = "Tensors, devices and collectives are placed as NCCL ranks on GPUs need them"
    rule_section = "Choose using measured memory"
    probe_class = DevicePlacementProbe
    strategies = ("ddp",)
    tiers = ("cpu", "gpu")

    def blames(self, run: Run) -> int | None:
        """A run stopped by a CUDA call the plugin cannot run on a CPU (its interception raised
        CudaNotMappable on every failed rank), or, on GPU ranks, by a device error of NCCL or CUDA."""
        failed = [r for r in run.job.ranks if r.status == "error"]
        if failed and all(r.exc_type == "CudaNotMappable" for r in failed):
            return Blame.RAISED
        if failed and _config(run)[1] == "gpu" and any(_gpu_error(r.message) for r in failed):
            return Blame.RAISED
        return super().blames(run)

    def judge(self, run: Run) -> Verdict:
        facts, world = _config(run)
        if facts is None:
            return self.not_judged("no rank built the user's objects, so nothing of their devices was recorded.")
        production = Production.of(facts)
        unreached = _unreached(run)
        set_device = [s for s in unreached if s["what"].startswith("torch.cuda.set_device")]
        items = [*kinds.host_collectives(run), *kinds.mixes(run), *kinds.numpy_calls(run), *kinds.unsynced_reads(run),
                 *kinds.fixed_indices(run),
                 *kinds.early_cuda(run, production.start), *kinds.worker_cuda(run),
                 *kinds.unset_device(run, set_device), *kinds.loads(run), *_gpu_raised(run, world)]
        items.sort(key=lambda i: (i.seq, i.order))
        failing = [i for i in items if production.breaks(i.needs)]
        notes = _unreached_note(unreached) + _unmapped_notes(run)
        if failing:
            return self._failed(production, failing, [i for i in items if i not in failing], notes)
        stopped = _unmapped(run)
        if items:
            return self._advisory(production, items, notes)
        if stopped is not None and not run.finished:
            at = [claim("site", f"stopped at {fmt_site(stopped['site'])}", frame=stopped["site"])] \
                if stopped.get("site") else []
            return self.not_judged(f"the run stopped at {fmt_site(stopped.get('site'))}: {stopped.get('api')} needs a "
                                   f"CUDA device ({stopped.get('why')}), which a CPU-only torch cannot give and the "
                                   f"plugin does not map; what ran before it showed no device fault.", claims=at)
        return self._passed(run, production, notes)

    def _failed(self, production: Production, failing: list, advisories: list, notes: list[str]) -> Verdict:
        lead = failing[0]
        more = len(failing) - 1
        config = _config_claim(f"Under the Trainer config ({production.words()})", production, failing + advisories,
                               failed=True)
        summary = (f"{config.text}, {lead.text}"
                   + (f"; and {more} more finding(s) below." if more else "."))
        evidence = [e for i in failing + advisories for e in i.evidence]
        others = [f"also: {i.text}." for i in failing[1:]] + [f"advisory (the configured run does not break on it): "
                                                               f"{i.text}." for i in advisories]
        fixes = _fixes(failing)
        return self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=fixes, notes=others + notes,
                            claims=[config, *(c for i in failing + advisories for c in i.claims)])

    def _advisory(self, production: Production, items: list, notes: list[str]) -> Verdict:
        lead = items[0]
        if production.gpu is None:
            config = _config_claim(f"The Trainer config is for CPU ranks ({production.words()})", production, items)
            why = f"{config.text}, where this runs as it did here; on GPU ranks, {lead.text}"
        else:
            config = _config_claim(f"Under the Trainer config ({production.words()})", production, items)
            why = f"{config.text} this does not break the run, but: {lead.text}"
        summary = why + (f"; and {len(items) - 1} more finding(s) below." if len(items) > 1 else ".")
        return self.verdict(Outcome.ADVISORY, summary, evidence=[e for i in items for e in i.evidence],
                            fix=_fixes(items),
                            notes=[f"also: {i.text}." for i in items[1:]] + notes,
                            claims=[config, *(c for i in items for c in i.claims)])

    def _passed(self, run: Run, production: Production, notes: list[str]) -> Verdict:
        counts = (run.probe(self.id)[0] or {}).get("counts")
        named = {(e["site"]["file"], e["site"]["line"]) for r in range(run.world_size)
                 for e in run.events(r, EV_CUDA) if e.get("site")}
        seen = _collectives_seen(run, counts)
        parts = [seen.text,
                 f"{plural(len(named), 'site')} of your code named a CUDA device, each the rank's own or its "
                 f"current one" if named else "your code named no CUDA device",
                 "no call mixed tensors of two devices"]
        listed = _attributes_note(kinds.plain_attributes(run))
        made = [seen] + ([listed] if listed else [])
        if listed:
            notes = [listed.text] + notes
        config = _config_claim(f"Under the Trainer config ({production.words()})", production, [])
        summary = f"{config.text}: " + "; ".join(parts) + "."
        return self.verdict(Outcome.PASSED, summary, notes=notes, empty=not _reached_a_step(run),
                            claims=[config, *made])


_SHOWN = 5


def _attributes_note(attributes: list[dict]) -> Claim | None:
    """The module's plain tensor attributes, as a listed claim: every name up to five, else the
    count with the first five. What a step did with them is not recorded, so it is not said."""
    if not attributes:
        return None
    names = [f"self.{a['attr']}" for a in attributes]
    shown = names if len(names) <= _SHOWN else names[:_SHOWN]
    listing = ", ".join(shown) if len(shown) == len(names) else f"first {len(shown)}: {', '.join(shown)}"
    one = len(attributes) == 1
    stay, them = ("stays where it was", "it") if one else ("stay where they were", "them")
    text = (f"{plural(len(attributes), 'plain tensor attribute')} ({listing}) {stay} made when Lightning moves the "
            f"module (on GPU ranks: the CPU). Register {them} with self.register_buffer(...) if a step uses {them}.")
    return claim("listed", text, names=names, shown=shown)


def _config_claim(text: str, production: Production, items: list, failed: bool = False) -> Claim:
    """The gpu-config claim of a verdict's opening: the config's GPU facts, what each finding needs
    to break the run, and whether the verdict fails."""
    return claim("gpu-config", text, gpu=production.gpu, per_node=production.per_node, nodes=production.nodes,
                 needs=[i.needs for i in items], failed=failed)


def _fixes(items: list) -> str:
    """Each finding's fix once, as sentences: "Do this. Also: do that"."""
    fixes = dict.fromkeys(i.fix[0].upper() + i.fix[1:] for i in items)
    return ". Also: ".join(f.rstrip(".") for f in fixes)


def _collectives_seen(run: Run, counts: dict | None) -> Claim:
    """What the collectives rank 0 made were given: counted by the probe on a finished run (the
    collectives made inside another, all_gather_object's allgather, counted apart and said, since
    their tensors are among those counted), read from the trace (calls only, no tensor counts) on one
    that stopped."""
    made = sum(1 for e in run.events(0, CALL) if e.get("kind") == "collective" and e.get("parent") is None)
    if not counts:
        text = (f"the {plural(made, 'collective')} rank 0 made before the run stopped got no tensor off the "
                f"rank's device")
        return claim("collectives-seen", text, collectives=made, nested=None, tensors=None)
    outer, nested = counts.get("collectives", made), counts.get("nested", 0)
    own, unplaced = counts.get("own", 0), counts.get("unplaced", 0)
    inside = f" (and the {plural(nested, 'collective')} made inside them)" if nested else ""
    text = (f"the {plural(outer, 'collective')} rank 0 made{inside} got {plural(own + unplaced, 'tensor')}: "
            f"{own} on the rank's own device, {unplaced} the run did not place (made inside torch or a library, or "
            f"on a device it cannot tell), none off the device")
    return claim("collectives-seen", text, collectives=outer, nested=nested, tensors=own + unplaced,
                 own=own, unplaced=unplaced, off=counts.get("off", 0))


def _reached_a_step(run: Run) -> bool:
    return any(HOOK.of(e) and str(e.get("name", "")).endswith("_step") for t in run.traces for e in t)


def _gpu_error(message: str | None) -> bool:
    return bool(message) and any(text in message for text in GPU_ERRORS)


def _gpu_raised(run: Run, world: str) -> list:
    """On GPU ranks, a rank that raised one of the device errors (the same findings, on real devices)."""
    if world != "gpu":
        return []
    raised = [r for r in run.job.ranks if r.status == "error" and _gpu_error(r.message)]
    if not raised:
        return []
    first = raised[0]
    text = f"rank {first.rank} raised {first.exc_type}: {(first.message or '').splitlines()[0][:300]}"
    evidence = [Evidence(f"{r.exc_type}: {(r.message or '').splitlines()[0][:200]}", rank=r.rank) for r in raised]
    return [kinds.Item("gpu", "gpu", text, evidence, "see the finding's own fix on the CPU tier "
                       "(pytest --ltconform-explain device-placement)", (-1, 0))]


def _unmapped(run: Run) -> dict | None:
    for r in range(run.world_size):
        event = next(iter(run.events(r, EV_UNMAPPED)), None)
        if event is not None:
            return event
    return None


def _unmapped_notes(run: Run) -> list[str]:
    stopped = _unmapped(run)
    if stopped is None:
        return []
    return [f"{stopped.get('api')} at {fmt_site(stopped.get('site'))} needs a CUDA device ({stopped.get('why')}): a "
            f"CPU-only torch cannot give it and the plugin does not map it, so what comes after it was not judged "
            f"here; the GPU tier (-m ltconform_gpu on a machine with GPUs) runs it."]


def _unreached(run: Run) -> list[dict]:
    """Sites of the user's files that name a CUDA index, set the device or load without
    map_location, that no rank reached (``source.static_sites``)."""
    reached = {(e["site"]["file"], e["site"]["line"]) for r in range(run.world_size) for ev in (EV_CUDA, EV_LOAD)
               for e in run.events(r, ev) if e.get("site")}
    paths = [p for _, p in user_classes(run)] + [p for _, p in user_classes(run, "datamodule")]
    if run.target is not None:
        paths.append(trainer_file(run.target))
    return [s for s in static_sites(paths) if (s["file"], s["line"]) not in reached]


def _unreached_note(unreached: list[dict]) -> list[str]:
    if not unreached:
        return []
    shown = "; ".join(f"{s['what']} at {fmt_site(s)}" for s in unreached[:4])
    more = f" and {len(unreached) - 4} more" if len(unreached) > 4 else ""
    return [f"found in your source but not reached by the run (not judged): {shown}{more}."]


CONTRACT = DevicePlacement()
