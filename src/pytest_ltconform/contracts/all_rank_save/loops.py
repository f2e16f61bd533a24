"""A loop in user code that stops on a per-rank condition while each pass through it makes a
collective (ZeRO-3 with a data-dependent loop).

Under DeepSpeed ZeRO stage 3 (and FSDP) every forward through a module whose parameters the
strategy shards gathers them from every rank: a collective. A decode or refinement loop that runs
until a condition each rank tests on its own data holds (``while not done.all():``, generate until
every sequence ended) runs a different number of times per rank, so the ranks' gathers stop pairing
up. Found from torch's Flight Recorder (``JobResult.mismatch``): a rank's mismatched collective is
a gather whose user frame lies inside a ``while`` loop (or a ``for`` loop left by ``break``) of the
user's function, and the ranks' gather counts up to the break differ. Pure Python on trace data.
"""

from __future__ import annotations

import ast
import linecache

from ...world.diagnose import trace_collectives
from ..base import Run

# Strategies whose forward gathers sharded parameters (a collective per module call).
SHARDING = {"deepspeed": "DeepSpeed ZeRO", "fsdp": "FSDP"}


def is_gather(op) -> bool:
    """all_gather, _allgather_base, allgather_into_tensor_coalesced, gather."""
    return "gather" in str(op or "").lower()


def _parse(path: str):
    source = "".join(linecache.getlines(path))
    try:
        return ast.parse(source) if source else None
    except SyntaxError:
        return None


def _leaves_by_break(loop: ast.For) -> bool:
    """A ``break`` of this loop itself (not of a loop nested in it)."""
    todo = list(loop.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Break):
            return True
        if not isinstance(node, (ast.For, ast.While, ast.AsyncFor, ast.FunctionDef, ast.AsyncFunctionDef,
                                 ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))
    return False


def enclosing_loop(site: dict | None) -> dict | None:
    """The innermost loop around the line of ``site`` that ends on a condition (a ``while``, or a
    ``for`` left by ``break``), in the same function: ``{"site": {file, line, func}, "source":
    its first line}``; None without one."""
    if not site or not site.get("file"):
        return None
    tree = _parse(site["file"])
    line = site.get("line") or 0
    best = None
    for node in ast.walk(tree) if tree else ():
        end = getattr(node, "end_lineno", None)
        if end is None or not (node.lineno <= line <= end):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and best and best.lineno < node.lineno:
            best = None  # a loop outside the function of the call is not this call's loop
        conditional = isinstance(node, ast.While) or (isinstance(node, (ast.For, ast.AsyncFor))
                                                      and _leaves_by_break(node))
        if conditional and (best is None or node.lineno > best.lineno):
            best = node
    if best is None:
        return None
    text = linecache.getline(site["file"], best.lineno).strip()
    return {"site": {"file": site["file"], "line": best.lineno, "func": site.get("func")}, "source": text}


def gather_counts(run: Run, pg, upto: int) -> dict[int, int]:
    """Per rank, the gathers among collectives #1..``upto`` of process group ``pg`` in its Flight
    Recorder (what the rank had issued by the collective where the ranks parted)."""
    counts = {}
    for outcome in run.job.ranks:
        entries = trace_collectives(outcome.trace)
        counts[outcome.rank] = sum(1 for (g, seq), e in entries.items()
                                   if g == pg and (seq or 0) <= upto and is_gather(e.get("op")))
    return counts


def loop_mismatch(run: Run) -> dict | None:
    """``{"rank", "call", "loop", "counts", "seq", "others"}`` when the first mismatched collective
    (Flight Recorder) is, on rank ``rank``, a gather made inside a conditional loop of user code
    under a sharding strategy, and the ranks' gather counts up to it differ; None otherwise."""
    mm = getattr(run.job, "mismatch", None)
    if not mm or run.strategy not in SHARDING:
        return None
    for rank, call in sorted((mm.get("calls") or {}).items()):
        loop = enclosing_loop(call.get("site")) if is_gather(call.get("op")) else None
        if loop is None:
            continue
        counts = gather_counts(run, mm.get("pg"), mm.get("broke_at") or mm.get("seq") or 0)
        if len(set(counts.values())) < 2:
            return None
        line = linecache.getline(call["site"]["file"], call["site"]["line"]).strip()
        others = {r: c for r, c in mm["calls"].items() if r != rank}
        return {"rank": rank, "call": call, "call_source": line, "loop": loop, "counts": counts,
                "seq": mm.get("seq"), "upto": mm.get("broke_at") or mm.get("seq"), "others": others}
    return None
