"""The contract registry: id -> module. Modules are imported only when a contract is used.

Each module (a file, or a folder ``<id>/`` whose ``__init__`` holds the contract and whose
``probe.py`` holds what runs on the ranks) defines ``CONTRACT``, an instance of
:class:`~.base.Contract`. A new contract is one module and one line here.
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
    "memory": "memory",
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


def run_spec(name: str):
    """The :class:`~..harness.RunSpec` called ``name`` that a registered contract declares;
    raises KeyError when none does."""
    for cid in _MODULES:
        spec = get_contract(cid).run_spec
        if spec.name == name:
            return spec
    raise KeyError(f"no contract declares a run called {name!r}")


def probes_for(name: str) -> list[tuple[str, str]]:
    """``[(contract_id, "module:Class")]`` of every contract that declares the run ``name`` and
    has a probe, in registry order: what the harness loads on the ranks of that run."""
    found = []
    for cid in _MODULES:
        contract = get_contract(cid)
        ref = contract.probe_ref() if contract.run_spec.name == name else None
        if ref is not None:
            found.append((cid, ref))
    return found


def blamed(run) -> str | None:
    """The contract named as the cause of an unfinished ``run``: the lowest claim of every
    contract's ``blames(run)`` (see :class:`~.base.Blame`); None when no contract claims it.
    When a rank raised in the user's own code, the collectives and logs its peers were left
    waiting in are consequences: only a contract its probe named the owner of the raise claims."""
    from .base import Blame

    crashed = run.raised_in_user_code()
    claims = []
    for order, cid in enumerate(_MODULES):
        claim = get_contract(cid).blames(run)
        if claim is not None and not (crashed and claim != Blame.RAISED):
            claims.append((claim, order, cid))
    return min(claims)[2] if claims else None
