"""device-placement, pytest side: what the user's source says about a device.

- :func:`index_source`: where a CUDA index at a recorded call comes from, read from the call's
  line and the assignments it leads back to in the same function (or the class's ``self.x =``):
  the local rank (``LOCAL_RANK``, ``self.local_rank``, ``torch.cuda.current_device()``,
  ``x.device``), the global rank (``self.global_rank``, ``dist.get_rank()``, ``RANK``) or unknown.
  On one node the two are the same number, so the run alone cannot tell them apart.
- :func:`static_sites`: the calls in the user's own files that name a CUDA device, set it or load
  a checkpoint without ``map_location``, for the sites a run did not reach (marked so).
"""

from __future__ import annotations

import ast
import re

from ..base import _parse

_LOCAL = re.compile(r"local_rank|LOCAL_RANK|current_device|\.device\b|root_device|device_ids|local_process_index")
_GLOBAL = re.compile(r"global_rank|get_rank\s*\(|['\"]RANK['\"]|\brank\b|SLURM_PROCID|process_index")


def _enclosing_function(tree, line: int):
    best = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno <= line <= (node.end_lineno or 0):
            if best is None or node.lineno > best.lineno:
                best = node
    return best


def _statement(tree, line: int):
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                                                  ast.If, ast.For, ast.While, ast.With, ast.Try)) \
                and node.lineno <= line <= (node.end_lineno or node.lineno):
            if best is None or node.lineno >= best.lineno:
                best = node
    return best


def _assigned(scope, name: str, before: int) -> list:
    """The values assigned to ``name`` in ``scope`` before line ``before`` (last first)."""
    found = []
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and node.lineno < before:
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id == name:
                    found.append((node.lineno, node.value))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.lineno < before and \
                isinstance(node.target, ast.Name) and node.target.id == name and node.value is not None:
            found.append((node.lineno, node.value))
    return [v for _, v in sorted(found, key=lambda f: -f[0])]


def _self_assigned(tree, attr: str) -> list:
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) and node.value is not None else []
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr == attr and \
                    isinstance(target.value, ast.Name) and target.value.id == "self":
                found.append(node.value)
    return found


def _expanded(tree, func, expr, depth: int = 3) -> str:
    """``expr`` as source, with the names it uses followed back to what they were assigned."""
    text = ast.unparse(expr)
    if depth == 0:
        return text
    parts = [text]
    for node in ast.walk(expr):
        if isinstance(node, ast.Name) and func is not None:
            for value in _assigned(func, node.id, getattr(expr, "lineno", 10 ** 9))[:1]:
                parts.append(_expanded(tree, func, value, depth - 1))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" and \
                not _LOCAL.search(node.attr) and not _GLOBAL.search(node.attr):
            for value in _self_assigned(tree, node.attr)[:1]:
                parts.append(_expanded(tree, _enclosing_function(tree, value.lineno), value, depth - 1))
    return " ".join(parts)


def index_source(site: dict | None) -> tuple[str | None, str]:
    """``(where, expression)`` of the device index at ``site``: where is 'local', 'global' or None
    (not readable, or neither), expression the call's device argument as written."""
    if not site or not site.get("file"):
        return None, ""
    tree = _parse(site["file"])
    line = site.get("line") or 0
    stmt = _statement(tree, line) if tree is not None else None
    if stmt is None:
        return None, ""
    func = _enclosing_function(tree, line)
    calls = [n for n in ast.walk(stmt) if isinstance(n, ast.Call)]
    args = [a for c in calls for a in (*c.args, *(k.value for k in c.keywords)) if _mentions_device(a)] or \
        [stmt.value] if isinstance(stmt, (ast.Assign, ast.Expr, ast.Return)) and stmt.value is not None else []
    if not args:
        return None, ""
    written = ast.unparse(args[0])
    text = " ".join(_expanded(tree, func, a) for a in args)
    if _LOCAL.search(text):
        return "local", written
    if _GLOBAL.search(text):
        return "global", written
    return None, written


def _mentions_device(node) -> bool:
    text = ast.unparse(node)
    return "cuda" in text or "device" in text or "rank" in text.lower()


# -- the static pass ----------------------------------------------------------------------------------

_CUDA_LITERAL = re.compile(r"^cuda:\d+$")


def static_sites(paths) -> list[dict]:
    """Calls in the files ``paths`` that name a CUDA device with an index, set the device, or call
    ``torch.load`` without ``map_location``: ``[{"file", "line", "func", "what"}]``."""
    found = []
    for path in dict.fromkeys(p for p in paths if p):
        tree = _parse(path)
        if tree is None:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                what = _static_call(node)
                if what:
                    func = _enclosing_function(tree, node.lineno)
                    found.append({"file": path, "line": node.lineno, "func": func.name if func else "<module>",
                                  "what": what})
    return found


def _static_call(node: ast.Call) -> str | None:
    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
    text = ast.unparse(node.func)
    keywords = {k.arg: k.value for k in node.keywords}
    literals = [a.value for a in (*node.args, *keywords.values()) if isinstance(a, ast.Constant)
                and isinstance(a.value, str) and _CUDA_LITERAL.match(a.value)]
    if literals:
        return f"{text}(...) names {literals[0]!r}"
    if name == "cuda" and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, int):
        return f".cuda({node.args[0].value})"
    if text.endswith("device") and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) and \
            node.args[0].value == "cuda" and isinstance(node.args[1], ast.Constant):
        return f"torch.device('cuda', {node.args[1].value!r})"
    if text.endswith("cuda.set_device"):
        return f"torch.cuda.set_device({ast.unparse(node.args[0]) if node.args else ''})"
    if text == "torch.load" and "map_location" not in keywords and len(node.args) < 2:
        return "torch.load(...) without map_location"
    return None
