"""pytest-ltconform: distributed-training conformance checks for PyTorch Lightning code.

Importing this package imports neither torch nor lightning; ``pytest_ltconform.Target`` (for the
``pytest_ltconform_targets`` hook in ``conftest.py``) is loaded on first use.
"""

__version__ = "0.1.0"

__all__ = ["Target"]


def __getattr__(name: str):
    if name == "Target":
        from .target import Target

        return Target
    raise AttributeError(f"module 'pytest_ltconform' has no attribute {name!r}")
