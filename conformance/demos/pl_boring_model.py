"""Conforming: the BoringModel of the standalone pytorch_lightning package (its own Trainer runs it)."""
from pytorch_lightning.demos.boring_classes import BoringModel as Model  # noqa: F401

SOURCE = "pytorch_lightning.demos"
EXPECTED = {
    "all-rank-save": "pass", "sync-dist": "pass", "unused-parameters": "pass", "configure-model": "pass",
    "eval-duplication": "pass", "data-sharding": "pass", "shared-writes": "pass", "strategy-config": "pass",
    "spawn-safety": "pass", "effective-batch": "pass",
}
EVIDENCE = "passes every contract"
