"""Conforming: the demo ManualOptimBoringModel (manual optimization, one backward per step)."""
from lightning.pytorch.demos.boring_classes import ManualOptimBoringModel as Model  # noqa: F401

SOURCE = "lightning.pytorch.demos"
EXPECTED = {
    "all-rank-save": "pass", "sync-dist": "pass", "unused-parameters": "pass", "configure-model": "pass",
    "eval-duplication": "pass", "data-sharding": "pass", "shared-writes": "pass", "strategy-config": "pass",
    "spawn-safety": "pass", "effective-batch": "pass",
}
EVIDENCE = "passes every contract"
