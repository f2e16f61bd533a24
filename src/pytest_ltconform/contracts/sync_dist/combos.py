"""Which of a step's metric outputs a logged value is made of (pure Python, both sides).

A value logged as ``torch.stack([auroc, acc]).sum()`` is not itself a tapped TorchMetrics output,
but it is still a per-batch nonlinear metric: find the small linear combination (one output, the
sum or the mean of a subset) that equals it, so that its epoch value can be recomputed part by part.
"""

from __future__ import annotations

import itertools

MAX_PARTS = 4  # larger combinations are neither common nor safe to guess


def close(a: float, b: float, rel: float = 1e-6) -> bool:
    """Equal within float32 rounding of a few additions."""
    return abs(a - b) <= rel * max(1.0, abs(a), abs(b))


def find_combinations(logged: float, values: list[float]) -> list[tuple[str, tuple[int, ...]]]:
    """Every combination of ``values`` equal to ``logged``, smallest first: ``[(mode, indices)]``
    with mode 'single', 'sum' or 'mean' and indices into ``values`` ascending; [] when none is.
    All sizes are kept: on a batch where two parts happen to be equal (an AUROC and an accuracy
    both 1.0) their mean also equals each part alone, and the caller keeps the combinations that
    hold on every batch."""
    found = []
    for size in range(1, min(MAX_PARTS, len(values)) + 1):
        for indices in itertools.combinations(range(len(values)), size):
            total = sum(values[i] for i in indices)
            if size == 1:
                if close(logged, total):
                    found.append(("single", indices))
            elif close(logged, total):
                found.append(("sum", indices))
            elif close(logged, total / size):
                found.append(("mean", indices))
    return found


def combine(mode: str, values: list[float]) -> float:
    """The value of a combination found by :func:`find_combinations`."""
    total = sum(values)
    return total / len(values) if mode == "mean" else total
