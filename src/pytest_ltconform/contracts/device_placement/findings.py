"""device-placement, pytest side: each kind of fault, from what every rank recorded.

One function per kind turns the ranks' events into :class:`Item` s: the sentence (what was
recorded and what GPU ranks would raise or do), the evidence per rank with the user's line, the
fix, and what the fault needs to break (``Production.breaks``: any GPU rank, several ranks, several
GPU ranks on one node, several nodes). The contract's verdict fails the items the configured run
would break and keeps the others as an advisory.
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict

from ...claims import Claim, claim
from ...cuda_on_cpu import EV_CUDA, EV_LOAD
from ...events import CALL, LOG
from ...sites import fmt_site, hook_label
from ..base import Evidence, Run
from .probe import (
    EV_ATTRIBUTES,
    EV_COLLECTIVE,
    EV_LOADED,
    EV_MIX,
    EV_NUMPY,
    EV_UNSET,
    EV_UNSYNCED,
    OBJECT_COLLECTIVES,
)
from .source import index_source

NO_BACKEND = "No backend type associated with device type cpu"
SAME_DEVICE = "Expected all tensors to be on the same device, but found at least two devices"
DUPLICATE = "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device"
ORDINAL = "CUDA error: invalid device ordinal"
REINIT = "Cannot re-initialize CUDA in forked subprocess"
FORK_CUDA = "Lightning can't create new processes if CUDA is already initialized"
NUMPY = "can't convert cuda:0 device type tensor to numpy"

# Calls that make CUDA current (a context on the device) when they run on a GPU.
_NOT_INITIALISING = ("torch.cuda.device_count",)


@dataclasses.dataclass
class Item:
    """One finding: ``needs`` says what it takes to break (see ``config.Production.breaks``)."""

    kind: str
    needs: str
    text: str
    evidence: list
    fix: str
    order: tuple = ()
    seq: int = 0  # when its first event happened on a rank: the fault GPU ranks meet first leads
    claims: list[Claim] = dataclasses.field(default_factory=list)  # parts of ``text`` with their facts


def _site_claim(api: str, site: dict | None) -> list[Claim]:
    """The claim that ``api at path:line`` names a line of the recorded frame (the user's frame the
    call came from, which may reach it through a helper, so the line's own call is not checked)."""
    frame = _frame(site)
    return [claim("site", f"{api} at {fmt_site(site)}", frame=frame)] if frame is not None else []


def _ev(run: Run, kind: str) -> dict[int, list[dict]]:
    return {r: [e for e in run.events(r) if e.get("ev") == kind] for r in range(run.world_size)}


def _site(site: dict | None) -> str:
    return fmt_site(site) if site else "(no user frame: inside Lightning)"


def _origin_words(origin: dict | None) -> str:
    if not origin:
        return "a tensor"
    how = origin.get("how") or "a tensor"
    if origin.get("attr"):
        at = f", set at {fmt_site(origin['site'])}" if origin.get("site") else ""
        return f"the plain attribute self.{origin['attr']}{at}"
    return f"a tensor made by {how} at {_site(origin.get('site'))}"


def _frame(site: dict | None) -> dict | None:
    return {k: site.get(k) for k in ("file", "line", "func")} if site and site.get("file") else None


def _ranks(ranks) -> str:
    ranks = sorted(set(ranks))
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


# -- a tensor on the host (or another GPU) given to a collective -------------------------------------

def host_collectives(run: Run) -> list[Item]:
    """A collective given a tensor that GPU ranks keep on the CPU (made without a device, a
    ``.cpu()`` copy, a plain attribute), or on a GPU other than the rank's; and a synced
    ``self.log`` of such a tensor, which Lightning all-reduces as it is."""
    logs = _synced_host_logs(run)
    by_origin = {origin: site for site, per_rank in logs.items() for e in per_rank.values()
                 for origin in [_key((e.get("device_origin") or {}).get("site"))]}
    groups: dict[tuple, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r, events in _ev(run, EV_COLLECTIVE).items():
        for e in events:
            origin = _key((e.get("origin") or {}).get("site")) or _key(e.get("site"))
            groups[(e.get("device") == "cpu", by_origin.get(origin, origin))][r].append(e)
    items = []
    for (host, key), per_rank in groups.items():
        items.append(_collective_item(host, per_rank, logs.pop(key, {})))
    for per_rank in logs.values():
        items.append(_log_item(per_rank))
    return items


def _key(site: dict | None) -> tuple | None:
    return (site.get("file"), site.get("line")) if site and site.get("file") else None


def _synced_host_logs(run: Run) -> dict[tuple, dict[int, dict]]:
    """Each rank's first synced self.log of a tensor that stays on the host, by the log's line."""
    out: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r in range(run.world_size):
        for e in run.events(r, LOG):
            if e.get("sync_dist") and not e.get("rank_zero_only") and e.get("device") == "cpu":
                out[_key(e.get("site"))].setdefault(r, e)
    return out


def _made(origins: list[dict | None]) -> str:
    """'a tensor made by X at site' for each distinct origin (the first two)."""
    seen = list(dict.fromkeys(_origin_words(o) for o in origins))
    return " and ".join(seen[:2]) + (f" (and {len(seen) - 2} more)" if len(seen) > 2 else "")


_HOST_FIX = ("make the tensor on the module's device: torch.tensor(value, device=self.device) (or .to(self.device) "
             "after a NumPy or CPU computation), or log a Python float, which Lightning puts on the device itself")


def _collective_item(host: bool, per_rank: dict, logs: dict[int, dict]) -> Item:
    first = min(per_rank.items())[1][0]
    origin = first.get("origin") or {}
    log = min(logs.items())[1] if logs else None
    ops = sorted({e["op"] for evs in per_rank.values() for e in evs})
    via = f" through self.log({log.get('name')!r}, ..., sync_dist=True) at {fmt_site(log.get('site'))}" if log else ""
    made = _made([e.get("origin") for evs in per_rank.values() for e in evs])
    ranks = {r: {"device": evs[0].get("device"), "own": evs[0].get("own")} for r, evs in sorted(per_rank.items())}
    if host:
        placed = claim("off-device", "on the CPU: on GPU ranks it stays on the CPU", ranks=ranks)
        text = (f"{made} reaches {', '.join(ops)}{via} {placed.text} while the "
                f"module is on each rank's GPU, and the default process group is NCCL only, so {ops[0]} raises "
                f"'{NO_BACKEND}' (torch 2.x; 'Tensors must be CUDA and dense' in older releases)")
        fix = _HOST_FIX
    else:
        placed = claim("off-device", f"on {first['device']} while the rank's own GPU is {first['own']}", ranks=ranks)
        text = (f"{made} reaches {', '.join(ops)} {placed.text} "
                f"on {_ranks(per_rank)}: NCCL then finds two ranks on one GPU ('{DUPLICATE}') or waits")
        fix = "take the device from the module (self.device) or the data (x.device), never a fixed index"
    evidence = []
    for r, evs in sorted(per_rank.items()):
        e = evs[0]
        where = f"{e['op']} (called at {fmt_site(e['site'])})" if e.get("site") else f"{e['op']} (Lightning's sync)"
        evidence.append(Evidence(f"{e.get('role', 'the tensor')} given to {where} would be on {e['device']}; this "
                                 f"rank's device is {e['own']}", rank=r,
                                 frame=_frame(origin.get("site")) or _frame(e.get("site"))))
    evidence += [Evidence(f"self.log({e.get('name')!r}, ..., sync_dist=True) logged it", rank=r,
                          frame=_frame(e["site"])) for r, e in sorted(logs.items())]
    return Item("collective", "ranks", text, evidence, fix, (5, (origin.get("site") or {}).get("line") or 0),
                _first_seq([*per_rank.values(), *([e] for e in logs.values())]), [placed])


def _log_item(per_rank: dict[int, dict]) -> Item:
    """A synced self.log of a host tensor whose sync this world did not reach (one rank, or not yet)."""
    first = min(per_rank.items())[1]
    origin = first.get("device_origin")
    placed = claim("off-device", "which GPU ranks keep on the CPU",
                   ranks={r: {"device": e.get("device"), "own": None} for r, e in sorted(per_rank.items())})
    text = (f"self.log({first.get('name')!r}, ..., sync_dist=True) at {fmt_site(first.get('site'))} logs "
            f"{_made([origin])}, {placed.text}: Lightning all-reduces a logged "
            f"tensor on its own device, and under NCCL that all_reduce raises '{NO_BACKEND}'")
    evidence = [Evidence(f"self.log({e.get('name')!r}, ..., sync_dist=True) of a tensor that would be on the CPU",
                         rank=r, frame=_frame(e.get("site"))) for r, e in sorted(per_rank.items())]
    line = ((origin or {}).get("site") or {}).get("line", 0)
    return Item("collective", "ranks", text, evidence, _HOST_FIX, (5, line),
                _first_seq([[e] for e in per_rank.values()]), [placed, *_site_claim("self.log", first.get("site"))])


def _first_seq(groups) -> int:
    """The earliest trace position among events (per rank: comparable enough to order findings)."""
    return min((e.get("seq") or 0 for group in groups for e in group), default=0)


# -- two devices in one call --------------------------------------------------------------------------

def mixes(run: Run) -> list[Item]:
    """A user frame's call with tensors that would be on two devices on GPU ranks."""
    by_site: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r, events in _ev(run, EV_MIX).items():
        for e in events:
            by_site[(e["site"]["file"], e["site"]["line"])].setdefault(r, e)
    items = []
    for (_, line), per_rank in by_site.items():
        r, first = min(per_rank.items())
        devices = first["devices"]
        two_gpus = all(d.startswith("cuda") for d in devices)
        parts = "; ".join(_origin_words(o) for o in first.get("origins") or [] if o)
        found = " and ".join(devices[:2])
        mixed = claim("mixed-devices", f"gets tensors on {' and '.join(devices[:2])}", devices=list(devices))
        # Each rank's own GPU differs: the devices are said as rank r's, and the others' beside them.
        others = "; ".join(f"rank {rr}: {' and '.join(e['devices'][:2])}" for rr, e in sorted(per_rank.items())
                           if rr != r)
        text = (f"{first['api']} at {fmt_site(first['site'])} {mixed.text} on rank {r}"
                + (f" ({others})" if others else "") + (f", with {parts}" if parts else "")
                + f": GPU ranks raise '{SAME_DEVICE}, {found}!'")
        if not two_gpus:
            text += " (a CPU tensor meets the module's device)"
        evidence = [Evidence(f"{e['api']} with tensors on {', '.join(e['devices'])} (this rank's own GPU is "
                             f"{e.get('own')}; {_why(e['why'])})", rank=rr, frame=_frame(e["site"]))
                    for rr, e in sorted(per_rank.items())]
        other = next((d for d in devices if d != first.get("own")), devices[-1])
        for rr in range(run.world_size):
            if rr not in per_rank:
                evidence.append(Evidence(f"no mix on this rank: {other} is this rank's own GPU" if two_gpus else
                                         "no mix recorded on this rank", rank=rr))
        fix = ("make every tensor the call uses on the module's device: derive it from the data (device=x.device, "
               "torch.zeros_like(x)) or from self.device; register fixed tensors with self.register_buffer(...), "
               "which .to() moves with the module")
        items.append(Item("mix", "node" if two_gpus else "gpu", text, evidence, fix, (6, line or 0),
                          _first_seq([[e] for e in per_rank.values()]),
                          [mixed, *_site_claim(first["api"], first["site"])]))
    return items


def _why(why: str) -> str:
    """The check that refused a mix, in words."""
    if "expected device meta" in why or "same device" in why:
        return "the meta device, which checks devices as CUDA does, refuses the call"
    return why


def numpy_calls(run: Run) -> list[Item]:
    """``.numpy()`` (or ``np.asarray``) of a tensor that GPU ranks have on their GPU."""
    by_site: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r, events in _ev(run, EV_NUMPY).items():
        for e in events:
            by_site[(e["site"]["file"], e["site"]["line"])].setdefault(r, e)
    items = []
    for (_, line), per_rank in by_site.items():
        first = min(per_rank.items())[1]
        text = (f"{first['api']} at {fmt_site(first['site'])} converts a tensor on the module's device to NumPy: "
                f"on GPU ranks it is a CUDA tensor and the call raises "
                f"'TypeError: {NUMPY}'")
        evidence = [Evidence(f"{e['api']} of a tensor on {e['device']}", rank=r, frame=_frame(e["site"]))
                    for r, e in sorted(per_rank.items())]
        items.append(Item("numpy", "gpu", text, evidence, "call .cpu() first: x.detach().cpu().numpy()", (7, line),
                          _first_seq([[e] for e in per_rank.values()]), _site_claim(first["api"], first["site"])))
    return items


def unsynced_reads(run: Run) -> list[Item]:
    """A copy to the CPU made with ``non_blocking=True`` read before ``torch.cuda.synchronize()``."""
    by_site: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r, events in _ev(run, EV_UNSYNCED).items():
        for e in events:
            by_site[(e["site"]["file"], e["site"]["line"])].setdefault(r, e)
    items = []
    for (_, line), per_rank in by_site.items():
        first = min(per_rank.items())[1]
        text = (f"{first['api']} at {fmt_site(first['site'])} reads a copy to the CPU made with non_blocking=True at "
                f"{_site(first.get('copy'))} before any torch.cuda.synchronize(): on GPU ranks that copy runs "
                f"asynchronously into pinned memory, so the values read may be what the buffer held before it "
                f"finished: wrong values, and nothing raises")
        evidence = [Evidence(f"{e['api']} read the non_blocking copy made at {_site(e.get('copy'))}", rank=r,
                             frame=_frame(e["site"])) for r, e in sorted(per_rank.items())]
        items.append(Item("unsynced", "gpu", text, evidence,
                          "call torch.cuda.synchronize() (or a CUDA event's synchronize()) before reading a "
                          "non_blocking copy to the CPU, or copy to the CPU without non_blocking", (7, line),
                          _first_seq([[e] for e in per_rank.values()]), _site_claim(first["api"], first["site"])))
    return items


# -- CUDA devices user code names ----------------------------------------------------------------------

def requests(run: Run) -> dict[tuple, dict[int, dict]]:
    """Each rank's CUDA requests by (file, line, api), made in the rank itself (not a worker)."""
    by_site: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r in range(run.world_size):
        loaded = _loaded_seq(run, r)
        for e in run.events(r, EV_CUDA):
            if e.get("worker") or not e.get("site"):
                continue
            e = {**e, "early": loaded is None or e.get("seq", 0) < loaded}
            by_site[(e["site"]["file"], e["site"]["line"], e["api"])].setdefault(r, e)
    return by_site


def _loaded_seq(run: Run, rank: int) -> int | None:
    loaded = next((e for e in run.events(rank, EV_LOADED)), None)
    return loaded.get("seq") if loaded else None


def fixed_indices(run: Run) -> list[Item]:
    """A CUDA index that is the same on every rank, or not the rank's own: every rank on one GPU;
    an index that is each rank's global rank: 'invalid device ordinal' past the first node."""
    items = []
    for (_, _line, api), per_rank in requests(run).items():
        indices = {r: e.get("index") for r, e in per_rank.items()}
        if any(i is None for i in indices.values()) or len(per_rank) < 2:
            continue
        wrong = {r: i for r, i in indices.items() if i != per_rank[r].get("local_rank", r)}
        first = min(per_rank.items())[1]
        if wrong and len(set(indices.values())) == 1:
            items.append(_same_index_item(run, api, first, per_rank, wrong))
        elif wrong:
            items.append(_wrong_index_item(api, first, per_rank, indices, wrong))
        else:
            where, written = index_source(first["site"])
            if where == "global":
                items.append(_global_index_item(api, first, per_rank, indices, written))
    return items


def _consequence(api: str, index: int) -> str:
    if api == "torch.cuda.set_device":
        return (f"every rank's current device is GPU {index}: what it allocates with 'cuda', and NCCL's object "
                f"collectives and barriers, land on GPU {index} ('{DUPLICATE}', or a hang)")
    if api == "torch.load(map_location)":
        return (f"every rank loads the file's tensors onto GPU {index}: one copy per rank on one GPU (apex#787's "
                f"'only one gpu does work'), out of memory there for a large model")
    if api == "Module.to":
        return f"every rank puts the module on GPU {index}, the other GPUs stay idle and GPU {index} runs out of memory"
    return (f"every rank makes its tensor on GPU {index}; on the ranks whose own GPU is another, it meets the "
            f"module's tensors ('{SAME_DEVICE}, cuda:1 and cuda:{index}!')")


def _mix_from(run: Run, site: dict) -> tuple[int, dict] | None:
    """The first recorded mix (rank, event) of a tensor made at ``site``."""
    for r, events in _ev(run, EV_MIX).items():
        for e in events:
            if any((o.get("site") or {}).get("line") == site.get("line") and (o.get("site") or {}).get("file") ==
                   site.get("file") for o in e.get("origins") or [] if o):
                return r, e
    return None


def _same_index_item(run: Run, api: str, first: dict, per_rank: dict, wrong: dict) -> Item:
    index = first["index"]
    asked = claim("cuda-index", f"asks for the hard-coded device 'cuda:{index}' on every rank", form="same",
                  **_indices(per_rank))
    text = (f"{api} at {fmt_site(first['site'])} {asked.text} "
            f"({_ranks(per_rank)}), while each rank's own GPU is cuda:<local rank>: {_consequence(api, index)}")
    seen = _mix_from(run, first["site"])
    if seen is not None:
        r, e = seen
        text += (f"; here, on rank {r}, {e['api']} at {fmt_site(e['site'])} gets it with the module's tensors "
                 f"({' and '.join(e['devices'][:2])})")
    evidence = [Evidence(f"{api} asked for cuda:{index}; " + (f"this rank's own GPU is cuda:{e.get('local_rank')}"
                                                              if r in wrong else "that is this rank's own GPU"),
                         rank=r, frame=_frame(e["site"])) for r, e in sorted(per_rank.items())]
    fix = ("take the device from the module or the data: self.device, x.device (or device=f'cuda:{self.local_rank}' "
           "where an index is needed); never a fixed index")
    return Item("index", "node", text, evidence, fix, (1, first["site"]["line"]),
                _first_seq([[e] for e in per_rank.values()]), [asked, *_site_claim(api, first["site"])])


def _indices(per_rank: dict[int, dict]) -> dict:
    """The facts of a cuda-index claim: each rank's asked index and its local rank."""
    return {"indices": {r: e.get("index") for r, e in sorted(per_rank.items())},
            "local": {r: e.get("local_rank", r) for r, e in sorted(per_rank.items())}}


def _wrong_index_item(api: str, first: dict, per_rank: dict, indices: dict, wrong: dict) -> Item:
    asked = claim("cuda-index", "asks each rank for a GPU that is not its own", form="wrong", **_indices(per_rank))
    text = (f"{api} at {fmt_site(first['site'])} {asked.text} "
            f"({', '.join(f'rank {r}: cuda:{i}' for r, i in sorted(indices.items()))}): GPU ranks whose index points "
            f"at a peer's GPU share it with that peer ('{DUPLICATE}') and meet the module's tensors on their own")
    evidence = [Evidence(f"{api} asked for cuda:{i}; this rank's own GPU is cuda:{r}", rank=r,
                         frame=_frame(first["site"])) for r, i in sorted(wrong.items())]
    return Item("index", "node", text, evidence, "use the local rank (self.local_rank) or self.device", (1, 0),
                first.get("seq") or 0, [asked, *_site_claim(api, first["site"])])


def _global_index_item(api: str, first: dict, per_rank: dict, indices: dict, written: str) -> Item:
    asked = claim("cuda-index", "takes its CUDA index from the global rank", form="global", **_indices(per_rank))
    text = (f"{api} at {fmt_site(first['site'])} {asked.text} ({written}): on one node "
            f"that is each rank's own GPU, as here, but on a second node rank N asks for cuda:N, a GPU the node does "
            f"not have ('{ORDINAL}')")
    evidence = [Evidence(f"{api} asked for cuda:{i} (global rank {r}, local rank {r} on this one-node world)", rank=r,
                         frame=_frame(first["site"])) for r, i in sorted(indices.items())]
    return Item("global-index", "nodes", text, evidence,
                "index by the local rank (self.local_rank, int(os.environ['LOCAL_RANK'])) or use self.device", (2, 0),
                first.get("seq") or 0, [asked, *_site_claim(api, first["site"])])


def early_cuda(run: Run, start: str | None) -> list[Item]:
    """CUDA made current at import, in __init__ or while the Trainer's arguments were built: under
    a forking strategy Lightning refuses to start; otherwise each process opens a context on GPU 0
    before its own device is set."""
    early = {k: v for k, v in requests(run).items() if any(e["early"] for e in v.values())
             and k[2] not in _NOT_INITIALISING and (start == "fork" or any(_on_gpu0(e) for e in v.values()))}
    if not early:
        return []
    (_, line, api), per_rank = min(early.items(), key=lambda kv: kv[0][1])
    first = min(per_rank.items())[1]
    where = "at import" if first["site"].get("func") == "<module>" else f"in {first['site'].get('func')}"
    more = f" (and {len(early) - 1} more such call(s))" if len(early) > 1 else ""
    if start == "fork":
        text = (f"{api} at {fmt_site(first['site'])} makes CUDA current {where}, before the Trainer starts its "
                f"processes{more}: the Trainer config forks them, and Lightning refuses ('{FORK_CUDA}'; a forked "
                f"process that used it raises '{REINIT}')")
        needs = "gpu"
    else:
        text = (f"{api} at {fmt_site(first['site'])} makes CUDA current {where}, before Lightning sets each rank's "
                f"device{more}: every process opens its CUDA context (and what it allocates) on GPU 0, so GPU 0 holds "
                f"one context per rank of the node")
        needs = "never"
    evidence = [Evidence(f"{api} {where} on cuda:{e['index'] if e.get('index') is not None else e.get('current', 0)}"
                         f" (asked: {e.get('device') or 'the current device'}), before the Trainer was built; this "
                         f"rank's own GPU is cuda:{e.get('local_rank')}", rank=r, frame=_frame(e["site"]))
                for r, e in sorted(per_rank.items())]
    fix = ("move CUDA calls out of import time and __init__ into a hook (setup, configure_model) or let Lightning "
           "move the module; build tensors on the device there")
    return [Item("early", needs, text, evidence, fix, (3, line), first.get("seq") or 0,
                 _site_claim(api, first["site"]))]


def _on_gpu0(e: dict) -> bool:
    """Whether an early request lands on a GPU not the rank's own: its index, or the current one
    (GPU 0 before any set_device) for a request without an index."""
    index = e.get("index") if e.get("index") is not None else e.get("current", 0)
    return index != e.get("local_rank")


def worker_cuda(run: Run) -> list[Item]:
    """CUDA asked for inside a DataLoader worker forked from the rank."""
    found = {}
    for r in range(run.world_size):
        for e in run.events(r, EV_CUDA):
            if e.get("worker") and e.get("site"):
                found.setdefault(r, e)
    if not found:
        return []
    first = min(found.items())[1]
    text = (f"{first['api']} at {fmt_site(first['site'])} asks for CUDA in a DataLoader worker: on GPU ranks the rank "
            f"has made CUDA current before it forks its workers, and the worker raises '{REINIT}'")
    evidence = [Evidence(f"{e['api']} in worker process {e['worker']}", rank=r, frame=_frame(e["site"]))
                for r, e in sorted(found.items())]
    return [Item("worker", "gpu", text, evidence, "keep the dataset on the CPU (Lightning moves each batch to the "
                 "device), or move data in transfer_batch_to_device / the step", (4, 0), first.get("seq") or 0,
                 _site_claim(first["api"], first["site"]))]


# -- object collectives before the device is set; torch.load ---------------------------------------------

def unset_device(run: Run, unreached_set_device: list[dict] = ()) -> list[Item]:
    """An object collective, barrier or collective on a user's NCCL group before the rank's CUDA
    device is current. ``unreached_set_device``: torch.cuda.set_device calls of the user's source
    that did not run here (behind ``torch.cuda.is_available()``, say): then whether the device is
    set first on GPU ranks is not known, and the finding is an advisory that says so."""
    found: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r, events in _ev(run, EV_UNSET).items():
        for e in events:
            site = e.get("site") or {}
            found[(site.get("file"), site.get("line"), e["op"])].setdefault(r, e)
    items = []
    for (_, line, op), per_rank in found.items():
        first = min(per_rank.items())[1]
        when = f"in {hook_label(first['hook'])}" if first.get("hook") else "before the Trainer was built"
        what = "stages the pickled object on" if op in OBJECT_COLLECTIVES else "runs on"
        text = (f"{op} at {_site(first.get('site'))} runs {when}, before any rank's CUDA device is set "
                f"(no torch.cuda.set_device yet; Lightning sets it when fit starts): under NCCL it {what} "
                f"torch.cuda.current_device(), which is GPU 0 on every rank of a node ('{DUPLICATE}', or the call "
                f"hangs)")
        needs = "node"
        if unreached_set_device:
            at = ", ".join(fmt_site(s) for s in unreached_set_device[:2])
            text += (f"; but torch.cuda.set_device at {at} did not run here (a condition such as "
                     f"torch.cuda.is_available() is false on CPU ranks), so whether GPU ranks set the device first "
                     f"could not be seen")
            needs = "never"
        evidence = [Evidence(f"{op} {when}, current CUDA device not set", rank=r, frame=_frame(e.get("site")))
                    for r, e in sorted(per_rank.items())]
        fix = ("set each rank's device before its first collective: "
               "torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) (or init_process_group(..., "
               "device_id=torch.device('cuda', local_rank))), or make the call in a hook once fit started "
               "(self.trainer.strategy.broadcast(obj))")
        items.append(Item("unset", needs, text, evidence, fix, (0, line or 0), first.get("seq") or 0,
                          _site_claim(op, first.get("site"))))
    return items


def loads(run: Run) -> list[Item]:
    """torch.load without map_location of a file whose tensors were saved on a GPU: every rank puts
    them on that GPU."""
    saved = {os.path.realpath(e["path"]) for r in range(run.world_size) for e in run.events(r, CALL)
             if e.get("kind") == "save" and e.get("path")}
    found: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r, events in _ev(run, EV_LOAD).items():
        for e in events:
            if e.get("map_location") is None and e.get("site") and (
                    e.get("cuda") or (e.get("path") and os.path.realpath(e["path"]) in saved)):
                found[(e["site"]["file"], e["site"]["line"])].setdefault(r, e)
    items = []
    for (_, line), per_rank in found.items():
        first = min(per_rank.items())[1]
        why = "its tensors were saved on a GPU" if first.get("cuda") else \
            "it is a checkpoint this run saved, which GPU ranks save with the tensors on their GPU"
        text = (f"torch.load at {fmt_site(first['site'])} has no map_location and "
                f"{why}: every rank loads them onto the GPU they were saved from (GPU 0 for rank 0's save), which "
                f"holds one copy per rank")
        evidence = [Evidence(f"torch.load({os.path.basename(e.get('path') or '?')!r}) without map_location", rank=r,
                             frame=_frame(e["site"])) for r, e in sorted(per_rank.items())]
        items.append(Item("load", "node", text, evidence,
                          "pass map_location=self.device (or 'cpu' and let Lightning move it)", (8, line),
                          first.get("seq") or 0, _site_claim("torch.load", first["site"])))
    return items


def plain_attributes(run: Run) -> list[dict]:
    """Rank 0's plain tensor attributes at fit start (``[{"attr", "device", "shape", "origin"}]``)."""
    event = next(iter(run.events(0, EV_ATTRIBUTES)), None)
    return list(event.get("attributes") or []) if event else []
