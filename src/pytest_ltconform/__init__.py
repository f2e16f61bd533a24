"""pytest-ltconform: distributed-training conformance checks for PyTorch Lightning code.

Importing this package imports neither torch nor lightning.
"""

__version__ = "0.1.0"
