"""The package's layers, checked from its source (docs/design.md, "Layers"): imports run one way,
imports inside functions included; the worlds import nothing above them; the session and its
policies name no contract; no function is longer than 60 lines."""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).parents[1] / "src"
PACKAGE = SRC / "pytest_ltconform"
# What world/ may not import: every layer above it.
ABOVE_WORLD = ("contracts", "trace", "tiers", "session", "policies", "plugin", "harness", "controller", "items")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _imported(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """The package's modules that ``name`` imports (relative imports resolved; a name imported
    from a package counts as its submodule when there is one)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target != "pytest_ltconform":
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def test_imports_run_one_way():
    graph = _graph()

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    # A package's __init__ may import its own modules (a registry, an interface); any other cycle is a fault.
    cycles = sorted(f"{a} <-> {b}" for a in graph for b in reach(a)
                    if a < b and a in reach(b) and not (b.startswith(a + ".") or a.startswith(b + ".")))
    assert not cycles, cycles


def test_the_worlds_import_nothing_above_them():
    above = tuple(f"pytest_ltconform.{m}" for m in ABOVE_WORLD)
    bad = sorted(f"{m} -> {t}" for m, targets in _graph().items() if m.startswith("pytest_ltconform.world")
                 for t in targets if t == above or t.startswith(above))
    assert not bad, bad


def test_the_session_and_its_policies_name_no_contract():
    from pytest_ltconform import contracts

    for name in ("session.py", "policies.py"):
        strings = [c.value for c in ast.walk(ast.parse((PACKAGE / name).read_text()))
                   if isinstance(c, ast.Constant) and isinstance(c.value, str)]
        named = [cid for cid in contracts.ids() for text in strings if text == cid or f"{cid}[" in text]
        assert not named, name


def test_no_function_is_longer_than_60_lines():
    long = [f"{path.relative_to(SRC)}:{node.lineno} {node.name}" for path in PACKAGE.rglob("*.py")
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60]
    assert not long, long


def test_the_check_sees_an_import_inside_a_function():
    # world/rank.py imports torch only inside its functions; the graph must still see package imports there.
    graph = _graph()
    assert "pytest_ltconform.world.job" in graph["pytest_ltconform.world.rank"]
    assert "pytest_ltconform.sharded" in graph["pytest_ltconform.harness"]  # imported inside traced_fit
