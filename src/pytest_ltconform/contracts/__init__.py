"""The contract registry: id -> module. Modules are imported only when a contract is used.

Each module defines ``CONTRACT``, an instance of :class:`~.base.Contract`.
"""

from __future__ import annotations

import importlib

_MODULES = {
    "all-rank-save": "all_rank_save",
    "sync-dist": "sync_dist",
    "unused-parameters": "unused_parameters",
    "eval-duplication": "eval_duplication",
    "configure-model": "configure_model",
    "data-sharding": "data_sharding",
    "shared-writes": "shared_writes",
    "strategy-config": "strategy_config",
    "spawn-safety": "spawn_safety",
    "effective-batch": "effective_batch",
    "launch-env": "launch_env",
}


def ids() -> list[str]:
    """Every registered contract id, in the order items are generated."""
    return list(_MODULES)


def get_contract(contract_id: str):
    """The ``Contract`` instance for ``contract_id``; raises KeyError naming the known ids."""
    try:
        module = _MODULES[contract_id]
    except KeyError:
        raise KeyError(f"unknown contract {contract_id!r}; known: {', '.join(_MODULES)}") from None
    return importlib.import_module(f"{__name__}.{module}").CONTRACT
