"""Conforming: Lightning's own demo BoringModel (lightning.pytorch.demos); no contract may flag it."""
from lightning.pytorch.demos.boring_classes import BoringModel as Model  # noqa: F401

SOURCE = "lightning.pytorch.demos"
EXPECTED = {
    "all-rank-save": "pass", "sync-dist": "pass", "unused-parameters": "pass", "configure-model": "pass",
    "eval-duplication": "pass", "data-sharding": "pass", "shared-writes": "pass", "strategy-config": "pass",
    "spawn-safety": "pass", "effective-batch": "pass",
}
EVIDENCE = "passes every contract"
