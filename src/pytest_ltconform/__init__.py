"""pytest-ltconform: distributed-training conformance checks for PyTorch Lightning code.

Importing this package imports neither torch nor lightning. ``pytest_ltconform.Target`` (for the
``pytest_ltconform_targets`` hook in ``conftest.py``), ``ResolvedTarget`` (what the
``ltconform_target`` fixture returns) and the types a project's own contract is
made of (for ``pytest_ltconform_contracts``: ``Contract``, ``Probe``, ``Verdict``, ``Evidence``,
``Outcome``, ``FIT``; docs/design.md, "Adding a contract") are loaded on first use.
"""

__version__ = "0.1.0"

__all__ = ["Contract", "Evidence", "FIT", "Outcome", "Probe", "ResolvedTarget", "Target", "Verdict"]

# name -> the module that defines it
_LAZY = {"Target": "target.spec", "ResolvedTarget": "target.spec", "Contract": "contracts.base",
         "Evidence": "contracts.base", "Verdict": "contracts.base", "Probe": "runs", "FIT": "runs",
         "Outcome": "outcomes"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'pytest_ltconform' has no attribute {name!r}")
