"""Where the user's code is, and how a place in it is written.

User code is every frame outside the libraries this plugin drives (torch, Lightning, TorchMetrics,
DeepSpeed), pytest, the standard library and this plugin itself. Evidence, fixes and hang
diagnoses all name places as ``path:line (function)``. Imported by every layer; imports nothing of
the plugin, and neither torch nor Lightning.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import sysconfig

# The libraries whose frames are never the user's: what the plugin drives, pytest, and itself.
# Exact import names, never a prefix: torch_geometric, torch_ema or lightning_habana are packages
# like any other, so their frames are the user's (docs/internals.md, Sites). functorch and torchgen ship
# in the torch wheel; triton is torch.compile's kernel runtime.
_LIB_PACKAGES = (
    "torch", "functorch", "torchgen", "triton", "lightning", "lightning_fabric", "pytorch_lightning",
    "lightning_utilities", "torchmetrics", "deepspeed", "pytest", "_pytest", "pluggy", "pytest_ltconform",
)
# Third-party code installed next to the standard library (a system or conda Python keeps
# site-packages inside the stdlib folder) is user code unless it is one of the libraries above.
_INSTALLED_DIRS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def _package_roots() -> tuple[str, ...]:
    roots = []
    for name in _LIB_PACKAGES:
        try:
            spec = importlib.util.find_spec(name) if name not in sys.modules else sys.modules[name].__spec__
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            roots.extend(os.path.realpath(p) + os.sep for p in spec.submodule_search_locations)
    return tuple(roots)


def _stdlib_roots() -> tuple[str, ...]:
    paths = {sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib")}
    return tuple(os.path.realpath(p) + os.sep for p in paths if p)


_ROOTS: tuple[tuple[str, ...], tuple[str, ...]] | None = None
_USER_CACHE: dict[str, bool] = {}


def is_user_file(filename: str) -> bool:
    """True for a source file of user code: any file outside torch, Lightning, TorchMetrics,
    DeepSpeed, pytest, the standard library and this plugin, wherever it is installed
    (a package in site-packages is user code). False for ``<string>``-like pseudo files."""
    global _ROOTS
    cached = _USER_CACHE.get(filename)
    if cached is not None:
        return cached
    if _ROOTS is None:
        _ROOTS = (_package_roots(), _stdlib_roots())
    packages, stdlib = _ROOTS
    if filename.startswith("<"):
        result = False
    else:
        real = os.path.realpath(filename)
        installed = next((real.split(d, 1)[1] for d in _INSTALLED_DIRS if d in real), None)
        in_stdlib = real.startswith(stdlib) and installed is None
        result = not (real.startswith(packages) or in_stdlib)
    _USER_CACHE[filename] = result
    return result


def is_installed(filename: str) -> bool:
    """True for a file of an installed package (under site-packages or dist-packages): user code
    by the rule above, but not the user's own project."""
    real = os.path.realpath(filename)
    return any(d in real for d in _INSTALLED_DIRS)


def _qualname(code) -> str:
    return getattr(code, "co_qualname", code.co_name)


def user_site(depth: int = 2, wrappers: tuple[str, ...] = ()) -> tuple[dict | None, bool]:
    """The first user frame above the caller's caller, and whether it is the immediate caller.

    ``wrappers``: names of the traced API itself (e.g. ``log``); a user-code function of that name
    is an override that forwards the call (a library's base class redefining ``self.log``), so the
    frame that called it is the one named. Returns ``({"file", "line", "func"}, direct)``;
    ``(None, False)`` when no frame is user code.
    """
    frame = sys._getframe(depth)
    direct = True
    while frame is not None:
        code = frame.f_code
        if is_user_file(code.co_filename):
            caller = frame.f_back
            if code.co_name in wrappers and caller is not None and is_user_file(caller.f_code.co_filename):
                frame = caller
                continue
            return {"file": code.co_filename, "line": frame.f_lineno, "func": _qualname(code)}, direct
        direct = False
        frame = frame.f_back
    return None, False


_PLUGIN_ROOT = os.path.dirname(os.path.abspath(__file__)) + os.sep
# Frames between a user's call and the library function it called that name nothing of either.
_PASS_THROUGH = ("contextlib.py", "functools.py")


def library_call(depth: int = 2) -> dict | None:
    """The library function that the first user frame above the caller's caller called (what the
    user sees as the call, e.g. ``Trainer.log_dir`` for a broadcast made inside that property):
    ``{"file", "line", "func", "property"}``, ``property`` saying whether the function is a
    property's getter; None when the caller's caller is itself user code or no frame is."""
    frame = sys._getframe(depth)
    called = None
    while frame is not None:
        code = frame.f_code
        if is_user_file(code.co_filename):
            break
        if not code.co_filename.endswith(_PASS_THROUGH) and not code.co_filename.startswith(_PLUGIN_ROOT):
            called = frame
        frame = frame.f_back
    if frame is None or called is None:
        return None
    code = called.f_code
    return {"file": code.co_filename, "line": called.f_lineno, "func": _attribute_name(called) or _qualname(code),
            "property": _is_getter(called)}


def _attribute_name(frame) -> str | None:
    """For a wrapper function that a library stores on an object in place of one of its methods
    (TorchMetrics' ``self.compute = self._wrap_compute(self.compute)``, whose frames run a nested
    ``wrapped_func``), the method the user called: ``MeanSquaredError.compute``, from the one
    attribute of ``self`` whose code the frame runs; None for any other frame."""
    if "<locals>" not in _qualname(frame.f_code):
        return None
    owner = frame.f_locals.get("self")
    try:
        found = [(name, value) for name, value in vars(owner).items()
                 if getattr(value, "__code__", None) is frame.f_code]
    except TypeError:  # no self, or one without a __dict__
        return None
    if len(found) != 1:
        return None
    name, value = found[0]
    wrapped = getattr(value, "__wrapped__", None)
    return getattr(wrapped, "__qualname__", None) or f"{type(owner).__name__}.{name}"


def _is_getter(frame) -> bool:
    """Whether ``frame`` runs a property's getter (``obj.name`` read, no call in the user's code)."""
    import inspect

    owner = frame.f_locals.get("self")
    if owner is None:
        return False
    attr = inspect.getattr_static(type(owner), frame.f_code.co_name, None)
    fget = getattr(attr, "fget", None) or getattr(attr, "func", None)  # property, functools.cached_property
    return getattr(fget, "__code__", None) is frame.f_code


# Set in a local world's ranks to the supervisor's working directory: a rank, whose own is its
# job folder, writes the user's paths relative to where pytest runs.
USER_CWD_ENV = "LTCONFORM_USER_CWD"


def fmt_site(site: dict | None) -> str:
    """``path:line (function)``; the path is relative when it is under the working directory (in
    a rank: pytest's, not the rank's job folder); an inherited method's site (``for``: the class
    it ran for) reads ``(Base.training_step, called for Sub)``."""
    if not site:
        return "<no user frame>"
    path = site.get("file", "?")
    try:
        rel = os.path.relpath(path, os.environ.get(USER_CWD_ENV) or os.getcwd())
        if not rel.startswith(".."):
            path = rel
    except ValueError:
        pass
    called = f", called for {site['for']}" if site.get("for") else ""
    return f"{path}:{site.get('line')} ({site.get('func')}{called})"


def frame_owner(filename: str) -> str:
    """Whose code a frame is: 'user', 'plugin' (this plugin's own, e.g. its CPU strategies) or
    'library' (torch, Lightning, TorchMetrics, DeepSpeed, pytest, the standard library)."""
    if is_user_file(filename):
        return "user"
    here = os.path.dirname(os.path.realpath(__file__)) + os.sep
    return "plugin" if os.path.realpath(filename).startswith(here) else "library"


def fmt_frame(frame: dict | None) -> str:
    """A frame as ``path:line (function)``: a user's path as :func:`fmt_site` writes it, a library's
    from its package folder on (``torch/nn/functional.py:2615 (embedding)``), not the whole path."""
    if not frame:
        return "<no frame>"
    path = str(frame.get("file", "?"))
    owner = frame_owner(path)
    if owner == "user":
        return fmt_site(frame)
    real = os.path.realpath(path)
    if owner == "plugin":  # from the package folder on, wherever the plugin is installed
        package = os.path.dirname(os.path.realpath(__file__))
        return f"{os.path.relpath(real, os.path.dirname(package))}:{frame.get('line')} ({frame.get('func')})"
    for marker in (*_INSTALLED_DIRS, os.sep + "lib" + os.sep):
        if marker in real:
            real = real.rsplit(marker, 1)[1]
            break
    return f"{real}:{frame.get('line')} ({frame.get('func')})"


def fmt_library(frame: dict | None) -> str:
    """A frame of a library the user's code called (an installed package, which counts as user code,
    or torch, Lightning, the standard library) from its package folder on:
    ``pandas/core/generic.py:3967 (NDFrame.to_csv)``; a frame of the user's own project as
    :func:`fmt_site` writes it."""
    if frame and is_installed(str(frame.get("file", ""))):
        real = os.path.realpath(str(frame["file"]))
        marker = next(d for d in _INSTALLED_DIRS if d in real)
        return f"{real.rsplit(marker, 1)[1]}:{frame.get('line')} ({frame.get('func')})"
    return fmt_frame(frame)


def hook_label(name: str | None) -> str:
    if not name:
        return "outside any hook"
    return name.split("]", 1)[-1] if name.startswith("[") else name


def plural(n: int, word: str) -> str:
    """``"1 call"``, ``"3 calls"``: a count with its noun."""
    return f"{n} {word}{'' if n == 1 else 's'}"


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_ADDRESS = re.compile(r"\s+(?:object )?at 0x[0-9a-fA-F]+(?=>)")


def no_addresses(text: str) -> str:
    """A message without the Python object addresses its reprs carry: ``<Foo object at 0x7f..>``
    becomes ``<Foo object>``, ``<function f at 0x7f..>`` ``<function f>`` (the names stay; an
    address says nothing to a reader and differs on every run)."""
    return _ADDRESS.sub(lambda m: " object" if "object" in m.group(0) else "", text or "")


def first_sentence(text: str | None, limit: int = 400) -> str:
    """The first sentence of an exception message, whole and without terminal colour codes;
    past ``limit`` characters it ends at a word boundary with ' ...' (never mid-word). '' for
    an empty message."""
    lines = [line.strip() for line in no_addresses(_ANSI.sub("", text or "")).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    if lines[0].endswith(":") and len(lines) > 1:
        # "Error(s) in loading state_dict for Model:" says nothing without the line it introduces.
        lines[0] = f"{lines[0]} {lines[1]}"
    first = re.split(r"(?<=[a-z0-9)`'\]])\.\s", lines[0], maxsplit=1)[0].rstrip(".")
    if len(first) > limit:
        first = first[:limit].rsplit(" ", 1)[0] + " ..."
    return first


# Lines of one rank's traceback or output that a report shows; the rest is counted in one line.
RANK_LINES = 30
# Frames of this plugin (its rank entry point, harness and taps) are not the user's business.
_PLUGIN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_FRAME_LINE = re.compile(r'^\s*File "(?P<file>[^"]+)", line \d+')
_CARETS = re.compile(r"^\s*[~^]+\s*$")


def bounded_lines(text: str | None, limit: int = RANK_LINES) -> list[str]:
    """``text`` (a traceback or output) as at most ``limit`` + 1 lines: frames of this plugin and
    caret-underline lines are dropped, then, when still longer, the first line and the last
    ``limit - 1`` lines are kept with one line in between saying how many were left out."""
    kept: list[str] = []
    skipping = False
    for line in (text or "").rstrip().splitlines():
        frame = _FRAME_LINE.match(line)
        if frame:
            skipping = os.path.abspath(frame.group("file")).startswith(_PLUGIN_DIR)
        elif skipping and line.startswith("    "):
            continue  # the source line of a dropped frame
        else:
            skipping = False
        if not skipping and not _CARETS.match(line):
            kept.append(line)
    if len(kept) <= limit:
        return kept
    left = len(kept) - limit
    return [kept[0], f"... ({left} lines left out)"] + kept[-(limit - 1):]
