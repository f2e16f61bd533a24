"""A seed derived from the local rank, which repeats on every node (data-sharding, nodes layout).

A script that offsets each process's seed by its local rank (``seed = base + int(os.environ[
"LOCAL_RANK"])``, then ``torch.manual_seed``/``seed_everything``/a ``torch.Generator``) gets a seed
of its own per process on one node, and the same seed on every node: the ranks with the same local
rank draw the same random stream (augmentation, noise, sampled or simulated data). Nothing is split
by the local rank there; the seed collides.

Found from the recorded facts only: each rank's place (``ds_place``: node, local rank), each
rank's seeding calls from user code (``user_seed``: function, value, site) and the user's reads
of the local rank (``env_rank_read`` from ``os.environ``; ``rank_read`` of ``self.local_rank`` /
``trainer.local_rank`` while data is built) in the function that seeded, at or before the
seeding line. :func:`collision` returns what the verdict names; :func:`sentence`, :func:`evidence`
and :data:`FIX` say it.
"""

from __future__ import annotations

from ...claims import claim
from ...events import ENV_RANK_READ, USER_SEED
from ...sites import fmt_site
from ..base import Evidence, Run
from ..rank_reads import RANK_READ
from .probe import DS_PLACE

FIX = ("derive the seed from the global rank (trainer.global_rank / RANK): seed = base_seed + "
       "self.trainer.global_rank, or base_seed + int(os.environ[\"RANK\"]); the local rank is the same on every "
       "node, so it tells processes apart only within one node.")


def _places(run: Run) -> list[dict] | None:
    """Each rank's node and local rank, when every rank recorded them and there are several nodes."""
    places = [next(iter(run.events(r, DS_PLACE)), None) for r in range(run.world_size)]
    if not all(places) or len({p["node"] for p in places}) < 2:
        return None
    return [{"node": p["node"], "local_rank": p["local_rank"]} for p in places]


def _local_reads(run: Run, rank: int) -> list[dict]:
    """``rank``'s recorded reads of its local rank by user code: {"what", "site", "code"}."""
    reads = [{"what": f'os.environ["{e.get("key")}"]', "site": e.get("site"), "code": e.get("code") or ""}
             for e in run.events(rank, ENV_RANK_READ) if e.get("site")]
    reads += [{"what": e.get("what"), "site": e.get("site"), "code": ""} for e in run.events(rank, RANK_READ)
              if e.get("use") == "data" and str(e.get("what", "")).endswith("local_rank") and e.get("site")]
    return reads


def _read_before(reads: list[dict], site: dict) -> dict | None:
    """The last read of the local rank in the seeding call's own function, at or before its line."""
    same = [r for r in reads if r["site"].get("file") == site.get("file") and r["site"].get("func") == site.get(
        "func") and r["site"].get("line", 0) <= site.get("line", 0)]
    return max(same, key=lambda r: r["site"]["line"]) if same else None


def _seeds(run: Run) -> dict[str, dict]:
    """user file:line -> {"site", "fns", "values": rank -> value} of the seeding calls made there."""
    out: dict = {}
    for r in range(run.world_size):
        for e in run.events(r, USER_SEED):
            if e.get("site") and isinstance(e.get("value"), int):
                key = fmt_site(e["site"])
                entry = out.setdefault(key, {"site": e["site"], "fns": [], "values": {}})
                if e.get("fn") not in entry["fns"]:
                    entry["fns"].append(e.get("fn"))
                entry["values"].setdefault(r, e["value"])
    return out


def collision(run: Run) -> dict | None:
    """The first seeding line where ranks on different nodes with the same local rank passed the
    same value, each having read its local rank in that function first; None otherwise."""
    places = _places(run)
    if places is None:
        return None
    for where, entry in _seeds(run).items():
        values = entry["values"]
        shared = sorted({a for a in values for b in values if a != b and values[a] == values[b]
                         and places[a]["node"] != places[b]["node"]
                         and places[a]["local_rank"] == places[b]["local_rank"]})
        reads = {r: _read_before(_local_reads(run, r), entry["site"]) for r in shared}
        if len(shared) >= 2 and all(reads.values()):
            return {"where": where, "fns": entry["fns"], "values": values, "ranks": shared, "reads": reads,
                    "places": {r: places[r] for r in shared}}
    return None


def sentence(found: dict):
    """The claim that names the shared seed: each rank's value, place, the line and the read."""
    ranks, places, values = found["ranks"], found["places"], found["values"]
    who = " and ".join(f"global rank {r} (node {places[r]['node']}, local rank {places[r]['local_rank']})"
                       for r in ranks)
    read = found["reads"][ranks[0]]
    code = f" (`{read['code']}`)" if read.get("code") else ""
    fns = " and ".join(found["fns"])
    text = (f"These ranks seeded with the same value, derived from the local rank: {who} each called {fns} with "
            f"{', '.join(f'{values[r]} on rank {r}' for r in ranks)} at {found['where']}, after reading "
            f"{read['what']} at {fmt_site(read['site'])}{code}; the local rank repeats on every node, so global "
            f"ranks with the same local rank on different nodes share the seed and draw the same random stream.")
    return claim("seed-collision", text, values={str(r): values[r] for r in ranks},
                 places={str(r): places[r] for r in ranks}, where=found["where"],
                 read=fmt_site(read["site"]))


def evidence(found: dict) -> list[Evidence]:
    """One line per sharing rank: its seed, node and local rank at the seeding line."""
    out = []
    for r in found["ranks"]:
        place = found["places"][r]
        read = found["reads"][r]
        out.append(Evidence(f"seeded {' and '.join(found['fns'])} with {found['values'][r]} (node {place['node']}, "
                            f"local rank {place['local_rank']}, read as {read['what']} at "
                            f"{fmt_site(read['site'])})", rank=r, site=found["where"]))
    return out


def seed_lines(found: dict | None) -> set[tuple]:
    """(file, line) of the reads that fed the shared seed: not a split of the data."""
    if not found:
        return set()
    return {(read["site"].get("file"), read["site"].get("line")) for read in found["reads"].values()}
