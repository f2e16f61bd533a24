"""The Lightning and torch releases the plugin is verified on, and the installed Lightning's.

The contracts' rules are written for Lightning :data:`RULES_RELEASE` (the seed's release); the
plugin is verified from :data:`FLOOR` on (docs/ci.md, "Versions": what ran on each release). Where
Lightning's behaviour a contract relies on changed between releases, the contract reads the
release that ran (:func:`of_object` on the ranks, recorded in the probe's data) and compares it
with a constant here that names the release the behaviour changed in, read from Lightning's
sources of each release:

- :data:`WRAPPER_FORWARDS_SET_EPOCH`: ``DistributedSamplerWrapper.set_epoch`` passes the epoch on to
  the user's sampler it wraps (``lightning.fabric.utilities.distributed``); before, the wrapped
  sampler keeps its first epoch's draw (the wrapper still shuffles its indices every epoch, so the
  train order changes either way: data-sharding's verdicts are the same, its page says so).
- :data:`LOAD_USES_TORCH_DEFAULT`: ``pl_load`` (resume from ``ckpt_path``, ``load_from_checkpoint``)
  passes ``weights_only=None``, torch's default (True from torch 2.6); before, it passes False.
- :data:`DEEPSPEED_TIMEOUT_ARGUMENT`: ``DeepSpeedStrategy(timeout=...)`` exists.

Nothing here imports torch or Lightning.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

Release = tuple[int, int, int]

RULES_RELEASE = "2.6.6"
FLOOR: Release = (2, 4, 0)
# The torch releases the matrix runs (tox.ini); the package accepts the range pyproject.toml states.
TESTED_TORCH = ("2.13.0", "2.14.1")

WRAPPER_FORWARDS_SET_EPOCH: Release = (2, 6, 1)
LOAD_USES_TORCH_DEFAULT: Release = (2, 6, 0)
DEEPSPEED_TIMEOUT_ARGUMENT: Release = (2, 5, 0)

# The distribution that provides each namespace's top-level package.
_DISTRIBUTIONS = {"lightning": "lightning", "pytorch_lightning": "pytorch-lightning"}


def parse(text: str | None) -> Release | None:
    """``"2.5.1.post0"`` -> ``(2, 5, 1)``; None for None or a text without a release number."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if not match:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def text(release: Release) -> str:
    return ".".join(map(str, release))


def of_namespace(namespace: str) -> str | None:
    """The installed version of the package providing ``namespace`` ('lightning.pytorch' or
    'pytorch_lightning'), from its distribution's metadata (no import); None when not installed."""
    top = namespace.split(".")[0]
    module = sys.modules.get(top)
    if getattr(module, "__version__", None):
        return str(module.__version__)
    try:
        return metadata.version(_DISTRIBUTIONS.get(top, top))
    except metadata.PackageNotFoundError:
        return None


def of_object(obj: object) -> str | None:
    """The version of the Lightning package that ``obj``'s class (a Trainer, a module) comes from."""
    for klass in type(obj).__mro__:
        top = klass.__module__.split(".")[0]
        if top in _DISTRIBUTIONS:
            return of_namespace(top)
    return None


def before(version: str | None, release: Release) -> bool:
    """Whether ``version`` (a version text) is older than ``release``. An unknown version is taken
    as the rules' release: the behaviour the rules describe."""
    parsed = parse(version)
    return parsed is not None and parsed < release


def unsupported(namespace: str) -> str | None:
    """A sentence when the installed package of ``namespace`` is older than :data:`FLOOR`, else
    None: the plugin is not verified there (Lightning 2.2 refuses FSDP on CPU, 2.3 needs
    pkg_resources, which setuptools 81 removed; docs/ci.md, Versions)."""
    version = of_namespace(namespace)
    if not before(version, FLOOR):
        return None
    dist = _DISTRIBUTIONS.get(namespace.split(".")[0], namespace)
    return (f"{dist} {version} is older than {text(FLOOR)}, the oldest release pytest-ltconform is verified on "
            f"(docs/ci.md, Versions). Install {dist}>={text(FLOOR)} next to the plugin, "
            f"e.g. pip install '{dist}>={text(FLOOR)}'.")
