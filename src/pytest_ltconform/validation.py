"""Where the session's targets are validated (imported, built, their Trainer kwargs checked).

Under the fork launcher a target is validated in a fresh process forked from the launcher's
parent (``world.LocalWorld.fresh``): the parent imports torch and Lightning once, for the ranks
and for this, and pytest itself imports neither (nor the user's code) to validate. Where ranks
are not forked (``--ltconform-launcher spawn``, a torchrun or SLURM world), and where pytest's
process imported Lightning already (a conftest did), it happens in this process, as
:func:`target.validation.validate` always did. Either way the errors are the same
:class:`target.spec.TargetError` paragraphs.
"""

from __future__ import annotations

import base64
import os
import pickle
import sys

from .target import loading as target_loading
from .target import spec as target_spec
from .target import validation as target_validation

ENTRY = "pytest_ltconform.validation:validate_in_child"
# A target's import may download weights or build a large model: minutes, not hours.
TIMEOUT_S = 900.0


def validate_here(kwargs: dict):
    """``target.validation.validate(**kwargs)`` in this process, its own user modules forgotten afterwards (so
    two folders with a ``model.py`` each do not meet)."""
    from .tiers import quiet_deepspeed_detection

    # A user module that imports deepspeed would otherwise print its accelerator warning.
    with target_loading.own_imports(), quiet_deepspeed_detection(), cuda_named_on_cpu():
        return target_validation.validate(**kwargs)


def cuda_named_on_cpu():
    """Validation imports the target, builds the module and calls its Trainer-kwargs target: where
    torch has no CUDA, code written for GPUs (``.cuda()`` in ``__init__``, ``torch.cuda.set_device``)
    runs on the CPU, as it does in the ranks (``cuda_on_cpu.where_no_cuda``; nothing is recorded)."""
    from .cuda_on_cpu import where_no_cuda

    return where_no_cuda()


def validate_forked(world, kwargs: dict, facts: dict) -> object | None:
    """Validate in a fresh process of ``world``'s fork parent: the ``target.spec.ResolvedTarget``,
    with what that process saw of the machine added to ``facts`` ("cuda": device count); None where
    ``world`` has no fork parent (the caller validates here). Raises
    :class:`target.spec.TargetError` for a bad target, a target whose import never finished or
    killed its process, and ``world.WorldStartError`` when the parent cannot start. Whatever else
    that process could not answer is left to pytest's own process (None), which then behaves as it
    did before validation moved out of it."""
    try:
        payload = base64.b64encode(pickle.dumps(kwargs)).decode()
    except Exception:
        return None  # unpicklable init or Trainer kwargs: validate() here names them
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the target resolves as it would here
    out = world.fresh(ENTRY, [payload], env=env, cwd=os.getcwd(), timeout_s=TIMEOUT_S)
    if out is None:
        return None
    if "target" in out:
        facts.update(out["facts"])
        return pickle.loads(base64.b64decode(out["target"]))
    where = f"{kwargs['options'][0]} {kwargs['model']!r}" if kwargs.get("options") else repr(kwargs.get("model"))
    if "error" in out:
        raise target_spec.TargetError(out["error"])
    if "timeout" in out:
        raise target_spec.TargetError(
            f"{where}: importing and building the target did not finish within {TIMEOUT_S:.0f} s (something at "
            f"import or in __init__ keeps running: training, a download, a server). Move it under "
            f"`if __name__ == \"__main__\":` or into a method the Trainer calls.")
    if "crashed" in out:
        raise target_spec.TargetError(
            f"{where}: the process importing and building the target died (exit status {out['crashed']}) "
            f"before it could report; its last output:\n{out.get('tail', '').strip()}")
    return None  # it could not say (its arguments did not unpickle there, a bug of ours): validate here


def validate_in_child(payload: str) -> dict:
    """The fresh process's side of :func:`validate_forked` (JSON out): ``{"target": pickled,
    "facts": {...}}``, ``{"error": TargetError text}``, or ``{"internal": traceback}`` for what
    only validating in pytest's own process can answer."""
    import traceback

    try:
        kwargs = pickle.loads(base64.b64decode(payload))
    except Exception:  # e.g. a callback class of a conftest that is not importable by name
        return {"internal": traceback.format_exc()}
    try:
        from .tiers import quiet_deepspeed_detection
        from .world.devices import cuda_device_count

        with quiet_deepspeed_detection(), cuda_named_on_cpu():
            resolved = target_validation.validate(**kwargs)
        facts = {"cuda": cuda_device_count()}
    except target_spec.TargetError as exc:
        return {"error": str(exc)}
    except BaseException:
        return {"internal": traceback.format_exc()}
    return {"target": base64.b64encode(pickle.dumps(resolved)).decode(), "facts": facts}


def deepspeed_missing_in_parent(world) -> str | None:
    """Why DeepSpeed cannot run here (the text of ``tiers.deepspeed_missing``), or None, as the
    fork parent of ``world`` finds it: it imports DeepSpeed once, for its ranks, so the check
    costs no second import. Imports it in this process where the parent cannot say (no fork
    parent, or it cannot start)."""
    from .tiers import deepspeed_missing, deepspeed_not_found, not_importable
    from .world import WorldStartError

    if not_found := deepspeed_not_found():
        return not_found
    try:
        failed = world.import_in_parent(["deepspeed"])
    except WorldStartError:
        failed = None
    if failed is None:
        return deepspeed_missing()
    why = failed.get("deepspeed")
    return None if why is None else not_importable(why)
