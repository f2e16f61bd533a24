"""The contract registry: id -> module. Modules are imported only when a contract is used.

Each module (a file, or a folder ``<id>/`` whose ``__init__`` holds the contract and whose
``probe.py`` holds what runs on the ranks) defines ``CONTRACT``, an instance of
:class:`~.base.Contract`. A new contract is one module and one line here; a project adds its own
through the ``pytest_ltconform_contracts`` hook (:func:`add`), judged after these.
"""

from __future__ import annotations

import importlib
import os
import re

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
    "device-placement": "device_placement",
    "node-local-files": "node_local_files",
}


# Contracts a project registered (pytest_ltconform_contracts), by id, in registration order.
_ADDED: dict = {}
# An id names items, markers and docs pages: lower-case words joined by dashes.
_ID = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")


def ids() -> list[str]:
    """Every registered contract id, in the order items are generated: the plugin's, then the
    project's."""
    return list(_MODULES) + list(_ADDED)


def rank_modules() -> tuple[str, ...]:
    """The plugin's own modules that run on the ranks: the harness and each built-in contract's
    probe (its ``probe.py``, or the contract module itself). A fork parent imports them once, so
    that no forked rank imports (or compiles) them again; a project's contracts are not among them."""
    folder = os.path.dirname(__file__)
    probes = [f"{__name__}.{m}.probe" if os.path.exists(os.path.join(folder, m, "probe.py")) else f"{__name__}.{m}"
              for m in _MODULES.values()]
    return ("pytest_ltconform.harness", *probes)


def preload(strategies) -> tuple[str, ...]:
    """Everything a fork parent imports once for runs under ``strategies``: the libraries they
    load on every rank (:func:`~pytest_ltconform.vocabulary.preload_modules`), then
    :func:`rank_modules`."""
    from ..vocabulary import preload_modules

    return preload_modules(strategies) + rank_modules()


def get_contract(contract_id: str):
    """The ``Contract`` instance for ``contract_id``; raises KeyError naming the known ids."""
    if contract_id in _ADDED:
        return _ADDED[contract_id]
    try:
        module = _MODULES[contract_id]
    except KeyError:
        raise KeyError(f"unknown contract {contract_id!r}; known: {', '.join(ids())}") from None
    return importlib.import_module(f"{__name__}.{module}").CONTRACT


def add(contract) -> None:
    """Register a project's contract (an instance of a :class:`~.base.Contract` subclass). Raises
    ValueError naming what is wrong with it and the fix."""
    from ..vocabulary import STRATEGIES, TIERS
    from .base import Contract, Probe

    what = f"{type(contract).__module__}.{type(contract).__qualname__}"
    if not isinstance(contract, Contract):
        raise ValueError(f"{contract!r} is not a contract: return instances of a "
                         f"pytest_ltconform.Contract subclass")
    if not isinstance(contract.id, str) or not _ID.fullmatch(contract.id):
        raise ValueError(f"{what} has id {contract.id!r}: set `id` to lower-case words joined by dashes, "
                         f"e.g. 'my-contract' (it names the items and markers)")
    if contract.id in _MODULES or contract.id in _ADDED:
        raise ValueError(f"{what} has id {contract.id!r}, which another contract has: choose another id")
    if type(contract).judge is Contract.judge:
        raise ValueError(f"{what} does not define judge(self, run): it returns the Verdict")
    if contract.probe_class is not None and not (isinstance(contract.probe_class, type)
                                                 and issubclass(contract.probe_class, Probe)):
        raise ValueError(f"{what}.probe_class is {contract.probe_class!r}: set it to a "
                         f"pytest_ltconform.Probe subclass, or None")
    unknown = [s for s in contract.strategies if s not in STRATEGIES] + \
        [t for t in contract.tiers if t not in TIERS]
    if unknown:
        raise ValueError(f"{what} names {', '.join(map(repr, unknown))}: strategies are "
                         f"{', '.join(STRATEGIES)}; tiers are {', '.join(TIERS)}")
    _ADDED[contract.id] = contract


def added() -> list:
    """The contracts a project registered (:func:`add`), in registration order."""
    return list(_ADDED.values())


def forget_added() -> None:
    """Unregister every project's contract (the pytest session that added them ended)."""
    _ADDED.clear()


def probes_for(spec) -> list[tuple[str, str]]:
    """``[(contract_id, "module:Class")]`` of every contract that declares the run ``spec`` (a
    :class:`~..runs.RunSpec`), or observes it, and has a probe, in registry order: what the harness
    loads on the ranks of that run."""
    found = []
    for cid in ids():
        contract = get_contract(cid)
        ref = contract.probe_ref() if contract.run_spec == spec or spec in contract.observes else None
        if ref is not None:
            found.append((cid, ref))
    return found


def plugin_choice(run) -> tuple[str, str, str, list] | None:
    """(contract id, reason, advisory, claims) of the first contract whose ``plugin_choice(run)`` explains
    the stop by something the plugin chose (see :meth:`~.base.Contract.plugin_choice`); None when none does."""
    for cid in ids():
        found = get_contract(cid).plugin_choice(run)
        if found is not None:
            return (cid, *found)
    return None


def blamed(run) -> str | None:
    """The contract named as the cause of an unfinished ``run``: the lowest claim of every
    contract's ``blames(run)`` (see :class:`~.base.Blame`); None when no contract claims it.
    When a rank raised in the user's own code, the collectives and logs its peers were left
    waiting in are consequences: only a contract its probe named the owner of the raise claims."""
    from .base import Blame

    crashed = run.raised_in_user_code()
    claims = []
    for order, cid in enumerate(ids()):
        claim = get_contract(cid).blames(run)
        if claim is not None and not (crashed and claim != Blame.RAISED):
            claims.append((claim, order, cid))
    return min(claims)[2] if claims else None
