"""Where the user's code is, and how a place in it is written.

User code is every frame outside the libraries this plugin drives (torch, Lightning, TorchMetrics,
DeepSpeed), pytest, the standard library and this plugin itself. Evidence, fixes and hang
diagnoses all name places as ``path:line (function)``. Imported by every layer; imports nothing of
the plugin, and neither torch nor Lightning.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig

_LIB_PACKAGES = (
    "torch", "lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities",
    "torchmetrics", "pytest_ltconform", "deepspeed",
)


def _library_roots() -> tuple[str, ...]:
    roots = []
    for name in _LIB_PACKAGES:
        spec = importlib.util.find_spec(name) if name not in sys.modules else sys.modules[name].__spec__
        if spec is not None and spec.submodule_search_locations:
            roots.extend(os.path.realpath(p) + os.sep for p in spec.submodule_search_locations)
    for key in ("stdlib", "platstdlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.append(os.path.realpath(path) + os.sep)
    return tuple(roots)


_ROOTS: tuple[str, ...] | None = None
_USER_CACHE: dict[str, bool] = {}


def is_user_file(filename: str) -> bool:
    """True for files that are neither torch, Lightning, TorchMetrics, the stdlib nor this package."""
    global _ROOTS
    cached = _USER_CACHE.get(filename)
    if cached is not None:
        return cached
    if _ROOTS is None:
        _ROOTS = _library_roots()
    if filename.startswith("<"):
        result = False
    else:
        real = os.path.realpath(filename)
        result = not real.startswith(_ROOTS) and "site-packages" + os.sep + "torch" not in real
    _USER_CACHE[filename] = result
    return result


def _qualname(code) -> str:
    return getattr(code, "co_qualname", code.co_name)


def user_site(depth: int = 2) -> tuple[dict | None, bool]:
    """The first user frame above the caller's caller, and whether it is the immediate caller.

    Returns ``({"file", "line", "func"}, direct)``; ``(None, False)`` when no frame is user code.
    """
    frame = sys._getframe(depth)
    direct = True
    while frame is not None:
        code = frame.f_code
        if is_user_file(code.co_filename):
            return {"file": code.co_filename, "line": frame.f_lineno, "func": _qualname(code)}, direct
        direct = False
        frame = frame.f_back
    return None, False


def fmt_site(site: dict | None) -> str:
    """``path:line (function)``; the path is relative when it is under the working directory."""
    if not site:
        return "<no user frame>"
    path = site.get("file", "?")
    try:
        rel = os.path.relpath(path)
        if not rel.startswith(".."):
            path = rel
    except ValueError:
        pass
    return f"{path}:{site.get('line')} ({site.get('func')})"


def hook_label(name: str | None) -> str:
    if not name:
        return "outside any hook"
    return name.split("]", 1)[-1] if name.startswith("[") else name


def plural(n: int, word: str) -> str:
    """``"1 call"``, ``"3 calls"``: a count with its noun."""
    return f"{n} {word}{'' if n == 1 else 's'}"
