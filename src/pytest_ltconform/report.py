"""Verdicts out: the per-item record carried on pytest reports, the terminal summary and the
JSON report (``--ltconform-report``).

The JSON keys are a stable interface for CI jobs and dashboards::

    {"target": str,            # the first target's module text (kept for readers of one target)
     "world_size": int, "versions": {"python", "torch", "lightning", ...},
     "results": [{"target", "contract", "strategy", "world_size", "outcome", "message", "summary",
                  "evidence", "duration_s", ...}],          # every item of every target
     "targets": [{"id", "model", "datamodule", "trainer", "init",
                  "results": [...]}],                       # the same records, per target, in order
     "cold_starts": int | null,  # generations of rank processes started (all xdist workers' together)
     "not_run": [{"tier", "reason", "items"}],  # tiers not run here and not asked for: a count each
     "interrupted": bool, "exitstatus": int,    # Ctrl-C, SIGTERM, -x or pytest.exit; pytest's exit code
     "runs": [{"target", "kind", "strategy", "tier", "nodes", "ranks_per_node"}],  # each run made,
                                 # once each (its one-rank reference is part of it), by any worker
     "imports": int | null,      # processes that imported torch and Lightning for the ranks (fork
                                 # parents, or every spawned rank)
     "seeding": {"mode", "seed", "ranks"}}      # --ltconform-seeding, its base seed, each rank's first seed

A record's ``evidence`` is ``[{"rank", "site", "detail", "frame"?}]``: ``site`` is the
``path:line (function)`` the line names, ``frame`` (where recorded) the ``{"file", "line",
"func"}`` it was written from. ``claims`` is ``[{"kind", "text", "facts"}]``: each sentence (or
clause) of the message that states something the run measured, verbatim in ``text``, with the
recorded facts it was made from in ``facts`` (per kind: ``values`` per rank or per side of a
comparison, the ``log`` call's flags, a ``frame``, a parameter's ``site`` ...); ``kind`` names
the check that holds the two together (``pytest_ltconform.claims.KINDS``, whose docstrings say
what each kind's facts are).
A memory item's record also has ``table`` (bytes per category, per rank measured, per strategy
predicted; see contract_docs/memory.md).
``outcome`` is one of 'passed', 'failed', 'advisory', 'skipped', 'error'; a record's ``target`` is
its target's id (the middle part of the item id ``ltconform::<id>::<contract>[<strategy>]``).
``trainer`` is the trainer target string, or for a dict given in ``conftest.py`` the dict with
values that are not plain JSON written as their ``repr`` without its memory address (two reports of
one config compare equal); ``init`` likewise (null when absent).
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import platform
import re
import tempfile
from importlib import metadata, resources

from .outcomes import Outcome

PROPERTY = "ltconform"

# "<pkg.Callback object at 0x7f..>": the address differs in every process.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def record(contract: str, strategy: str, world_size: int, verdict_dict: dict, duration_s: float,
           target: str | None = None) -> dict:
    """The JSON record of one item (see the module doc); ``target`` is the target's id."""
    return {"target": target, "contract": contract, "strategy": strategy, "world_size": world_size,
            "outcome": verdict_dict["outcome"], "message": verdict_dict["message"],
            "block": verdict_dict.get("block"), "partial": verdict_dict.get("partial", False),
            "summary": verdict_dict.get("summary"), "category": verdict_dict.get("category"),
            "fix": verdict_dict.get("fix"), "rule_section": verdict_dict.get("rule_section"),
            "evidence": verdict_dict.get("evidence", []), "notes": list(verdict_dict.get("notes", [])),
            "claims": list(verdict_dict.get("claims", [])),
            "duration_s": round(duration_s, 3), **_figures(verdict_dict)}


def _figures(verdict_dict: dict) -> dict:
    """A verdict's table of figures (the memory contract's bytes per category, rank and strategy)."""
    return {"table": verdict_dict["table"]} if verdict_dict.get("table") is not None else {}


def from_report(report) -> dict | None:
    """The ltconform record a pytest report carries (survives pytest-xdist serialisation)."""
    for name, value in getattr(report, "user_properties", ()) or ():
        if name == PROPERTY:
            return json.loads(value)
    return None


def versions() -> dict:
    found = {"python": platform.python_version()}
    for dist in ("torch", "lightning", "pytorch-lightning", "torchmetrics", "deepspeed", "pytest",
                 "pytest-ltconform"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    return found


def _plain(value):
    """``value`` as JSON: plain values as they are, containers walked, anything else as its repr."""
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return _ADDRESS.sub("", repr(value))


def target_entry(t) -> dict:
    """The report's entry of one validated target (``target.spec.ResolvedTarget``), without its
    records: plain JSON (what a pytest-xdist worker hands its controller)."""
    trainer = t.trainer.text if t.trainer is not None else _plain(t.trainer_dict)
    return {"id": t.label, "model": t.model.text, "datamodule": t.datamodule.text if t.datamodule is not None else None,
            "trainer": trainer, "init": _plain(t.init)}


def target_entries(targets: list, results: list[dict]) -> list[dict]:
    """The report's ``targets`` list: each validated target (``target.spec.ResolvedTarget``, or
    its :func:`target_entry`) with its records."""
    entries = []
    for t in targets:
        entry = dict(t) if isinstance(t, dict) else target_entry(t)
        entries.append({**entry, "results": [r for r in results if r.get("target") == entry["id"]]})
    return entries


def write_json(path: str, target: str | None, world_size: int, results: list[dict], targets: list | None = None,
               cold_starts: int | None = None, not_run: list[dict] | None = None, interrupted: bool = False,
               exitstatus: int = 0, runs: list[dict] | None = None, imports: int | None = None,
               seeding: dict | None = None) -> None:
    """Write the report to ``path`` (creating its folder) through a temporary file beside it, so
    that a failed write leaves the previous report, not half of a new one (a path that is not a
    regular file, such as a device or a pipe, is written in place). ``targets`` are the
    validated ``target.spec.ResolvedTarget`` of the session (or their :func:`target_entry`);
    ``cold_starts`` the worlds it started; ``not_run`` the tiers whose items were not created here;
    ``runs`` the runs made, ``imports`` the processes that imported the ranks' preload (see the
    module doc). Raises ``OSError``."""
    doc = {"target": target, "world_size": world_size, "versions": versions(), "results": results,
           "targets": target_entries(targets or [], results), "cold_starts": cold_starts,
           "not_run": not_run or [], "interrupted": interrupted, "exitstatus": exitstatus,
           "runs": runs or [], "imports": imports}
    if seeding is not None:
        doc["seeding"] = seeding
    if os.path.exists(path) and not os.path.isfile(path):
        # A device or a pipe (/dev/stdout, a FIFO a CI step reads): written in place, since replacing
        # it would put a file where the device was; its errors (ENOSPC on /dev/full) raise as any write's.
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
        return
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".ltconform-report-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the report from a CI job's other users
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def seeding_entry(seeding: str, seed: int, world_size: int) -> dict:
    """The report's ``seeding``: the mode, the base seed, and the seed each rank starts a fit with
    (under "both" every rank is reseeded with ``seed`` when training starts)."""
    ranks = [seed if seeding == "same" else seed + r for r in range(world_size)]
    return {"mode": seeding, "seed": seed, "ranks": ranks}


def contract_pages() -> list[str]:
    """Ids of the contracts whose rule pages ship in the package (``contract_docs/<id>.md``)."""
    folder = resources.files(__package__) / "contract_docs"
    return sorted(p.name[:-3] for p in folder.iterdir() if p.name.endswith(".md"))


def contract_page(contract: str) -> str | None:
    """The rule page of ``contract`` (markdown, as the docs site shows it); None for an unknown id."""
    if contract not in contract_pages():
        return None
    return (resources.files(__package__) / "contract_docs" / f"{contract}.md").read_text(encoding="utf-8")


def own_contract_page(contract) -> str:
    """The page of a contract a project registered (``pytest_ltconform_contracts``), which ships no
    page of its own: its title, its class's docstring, the rules' section it enforces, where it runs."""
    import inspect

    cls = type(contract)
    lines = [f"# {contract.id}", ""]
    if contract.title:
        lines += [f"**{contract.title}**", ""]
    doc = vars(cls).get("__doc__")  # its own, not one inherited from Contract
    if doc:
        lines += [inspect.cleandoc(doc), ""]
    if contract.rule_section:
        lines += [f"Rule: the '{contract.rule_section}' section of the distributed-training contracts "
                  f"(Lightning 2.6.6).", ""]
    lines += [f"Strategies: {', '.join(contract.strategies)}; tiers: {', '.join(contract.tiers)}.",
              f"A contract of this project: {cls.__module__}.{cls.__qualname__}, registered through "
              f"pytest_ltconform_contracts."]
    return "\n".join(lines) + "\n"


def unknown_contract(contract: str, own: list[str] = ()) -> str:
    """The message for --ltconform-explain of an id that has no page: the close id, and every id
    (the plugin's, then ``own``: those of the project's contracts)."""
    import difflib

    ids = contract_pages() + list(own)
    close = difflib.get_close_matches(contract.lower().replace("_", "-"), ids, n=1) or \
        difflib.get_close_matches(contract, ids, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"no contract {contract!r}.{hint} Choose from {', '.join(ids)}."


_STYLE = {"passed": "green", "failed": "red", "advisory": "yellow", "error": "magenta", "skipped": "yellow"}


def summary_text(results: list[dict], width: int, color: bool, blocks: bool = False, details: bool = False) -> str:
    """Per target, a heading line with its id and its contract x strategy table; then one line per
    advisory (``details``, for ``-vv``: its evidence block; ``-rA`` prints it under ADVISORIES and
    the JSON report has it), one line per failed item (its block is in pytest's FAILURES;
    ``blocks``: here too, for ``--tb=no``, without the hang diagnosis), then one line per item not
    judged. Blocks and lines name the target (``<id>::<contract>[<strategy>]``) when there are
    several."""
    from rich.console import Console
    from rich.markup import escape

    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=color, no_color=not color,
                      color_system="standard" if color else None, highlight=False)
    groups: dict = {}
    for r in results:
        groups.setdefault(r.get("target"), []).append(r)
    partial = False
    for n, (target, records) in enumerate(groups.items()):
        if target is not None:
            heading = f"target {escape(target)}"
            console.print(("\n" if n else "") + (f"[bold]{heading}[/bold]" if color else heading))
        partial = _table(console, records, color) or partial
    if partial:
        console.print("* judged on what every rank recorded before the world stopped (see the failed item)")
    several = len(groups) > 1

    def name(r: dict) -> str:
        prefix = f"{r['target']}::" if several and r.get("target") else ""
        return f"{prefix}{r['contract']}[{r['strategy']}]"

    # A required tier missing here fails each of its items with one message: said once.
    same = collections.Counter(r["message"] for r in results if r.get("category") == "unavailable")
    said, failed, advisory = set(), [], []
    for r in results:
        unavailable = r.get("category") == "unavailable"
        if unavailable and r["message"] in said:
            continue
        if unavailable:
            said.add(r["message"])
        more = same[r["message"]] - 1 if unavailable else 0
        title = name(r) + (f" and {more} more item(s) of that tier" if more else "")
        if r["outcome"] == Outcome.FAILED and not blocks:
            failed.append(f"{title}: {_first_line(r)}")
        elif r["outcome"] == Outcome.ADVISORY and not details:
            advisory.append(f"{title}: {_first_line(r)}")  # a green run reads at a glance
        elif r["outcome"] in (Outcome.FAILED, Outcome.ADVISORY):
            console.rule(escape(title), style="" if not color else _STYLE[r["outcome"]])
            # soft_wrap: long paths stay on one line, so they can be copied.
            console.print(r.get("block") or r["message"], markup=False, highlight=False, soft_wrap=True)
    _lines(console, "advisory (the evidence: -rA, -vv or the JSON report)", advisory)
    _lines(console, "failed (each block is in FAILURES above)", failed)
    _lines(console, "not judged", [f"{name(r)}: {_first_line(r)}" for r in results if r["outcome"] == Outcome.ERROR])
    return buf.getvalue().rstrip("\n")


def _first_line(r: dict) -> str:
    return (r.get("summary") or r["message"]).splitlines()[0]


def _lines(console, title: str, lines: list[str]) -> None:
    if lines:
        console.rule(title)
        for line in lines:
            console.print(line, markup=False, highlight=False, soft_wrap=True)


def _table(console, results: list[dict], color: bool) -> bool:
    """Print one target's contract x strategy table; True when a cell was judged on part of a run."""
    from rich import box
    from rich.table import Table

    contracts = list(dict.fromkeys(r["contract"] for r in results))
    strategies = list(dict.fromkeys(r["strategy"] for r in results))
    cell = {(r["contract"], r["strategy"]): r for r in results}
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("contract")
    for s in strategies:
        table.add_column(s)
    partial = False
    for c in contracts:
        row = [c]
        for s in strategies:
            r = cell.get((c, s))
            if r is None:
                row.append("-")
                continue
            text = r["outcome"] + ("*" if r.get("partial") else "")
            partial = partial or bool(r.get("partial"))
            style = _STYLE.get(r["outcome"], "")
            row.append(f"[{style}]{text}[/{style}]" if color and style else text)
        table.add_row(*row)
    console.print(table)
    return partial
