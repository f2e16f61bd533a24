"""Per-batch nonlinear metrics: recompute a logged epoch value over the epoch's samples (pytest side).

The probe keeps, for every mean-reduced epoch log made of tapped TorchMetrics outputs, the inputs
of each part on every batch and rank. A part is nonlinear in this run when its epoch-level value
differs from the sample-weighted mean of its per-batch values (AUROC, F1); a linear part
(accuracy, MSE) gives the same number either way and never fails on its own.
"""

from __future__ import annotations

import importlib

from .combos import combine


def _tol(truth: float) -> float:
    return max(1e-4, 1e-3 * abs(truth))


def common_signature(records: list[dict]) -> str | None:
    """The combination that made the logged value on every batch of every rank (smallest first)."""
    sigs = None
    for record in records:
        for batch in record["batches"]:
            sigs = set(batch["combos"]) if sigs is None else sigs & set(batch["combos"])
    if not sigs:
        return None
    return min(sigs, key=lambda s: (s.count(",") + 1, s))


def _concat(values: list):
    """One batch's inputs joined along the sample axis: tensors, NumPy arrays or lists (what a
    scikit-learn metric is given); anything else (a threshold, a class count) is the first batch's."""
    import torch

    if isinstance(values[0], torch.Tensor):
        return torch.cat([v.reshape(-1, *v.shape[1:]) if v.dim() else v.reshape(1) for v in values])
    if hasattr(values[0], "ndim") and hasattr(values[0], "shape") and values[0].ndim:
        import numpy

        return numpy.concatenate(values)
    if isinstance(values[0], (list, tuple)):
        return [item for v in values for item in v]
    return values[0]


def _rows(part: dict) -> int:
    args = part["args"]
    first = args[0] if args else None
    if hasattr(first, "shape") and getattr(first, "ndim", None if not hasattr(first, "dim") else first.dim()):
        return int(first.shape[0])
    return len(first) if isinstance(first, (list, tuple)) else 1


def recompute(calls: list[dict], template=None) -> tuple[float | None, int]:
    """(epoch-level value, number of samples) of one part over every batch's inputs ``calls``
    (``{"args", "kwargs", "kind", "fn"}``); raises when the inputs do not concatenate."""
    if not calls:
        return None, 0
    n_args = len(calls[0]["args"])
    args = [_concat([c["args"][i] for c in calls]) for i in range(n_args)]
    kwargs = calls[0]["kwargs"]
    n = sum(_rows(c) for c in calls) if n_args else len(calls)
    if calls[0]["kind"] == "functional":
        module_name, _, fn_name = calls[0]["fn"].rpartition(".")
        fn = getattr(importlib.import_module(module_name), fn_name)
        fn = getattr(fn, "__wrapped__", fn)
        value = fn(*args, **kwargs)
    else:
        template.reset()
        template.update(*args, **kwargs)
        value = template.compute()
    return float(value), n


def analyse(records: list[dict]) -> dict | None:
    """The combination behind a logged key on every rank and each part's numbers:
    ``{"mode", "parts": [{"label", "kind", "name", "fn", "truth", "batch_mean", "nonlinear"}],
    "truth", "samples"}``; None without a common combination or when inputs do not concatenate."""
    sig = common_signature(records)
    if sig is None:
        return None
    first = records[0]["batches"][0]["combos"][sig]
    parts = []
    samples = 0
    for j, head in enumerate(first["parts"]):
        calls = [b["combos"][sig]["parts"][j] for r in records for b in r["batches"]]
        template = records[0]["templates"].get(head["key"])
        try:
            truth, samples = recompute(calls, template)
        except Exception:  # inputs that do not concatenate: no epoch value to compare
            return None
        if truth is None:
            return None
        weighted = [(c["value"], _rows(c)) for c in calls if c.get("value") is not None]
        total = sum(w for _, w in weighted)
        batch_mean = sum(v * w for v, w in weighted) / total if total else None
        nonlinear = batch_mean is None or abs(batch_mean - truth) > _tol(truth)
        parts.append({"label": head["label"], "kind": head["kind"], "name": head["name"], "fn": head.get("fn"),
                      "truth": truth, "batch_mean": batch_mean, "nonlinear": nonlinear})
    truth = combine(first["mode"], [p["truth"] for p in parts])
    return {"mode": first["mode"], "parts": parts, "truth": truth, "samples": samples}


def differs(logged: float, truth: float) -> bool:
    return abs(logged - truth) > _tol(truth)
