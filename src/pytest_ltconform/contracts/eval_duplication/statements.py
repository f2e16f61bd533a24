"""The sentences eval-duplication makes of a published value against the one-device value, each
with the claim it rests on (``..claims``): which rank's value it uses, and what the difference is.

A value every rank holds (synced, or equal by chance) is "<key> <v> on <N> ranks"; a value the
ranks hold differently (logged without a sync) is rank 0's, said so, with the others beside it.
"""

from __future__ import annotations

import math

from ...claims import Claim, claim


def fmt(v: float) -> str:
    return f"{v:.4f}".rstrip("0").rstrip(".") if abs(v) < 1e6 else f"{v:.4g}"


def close(value: float, reference: float) -> bool:
    return math.isclose(value, reference, rel_tol=1e-4, abs_tol=1e-6)


def agree(values: list) -> bool:
    """Whether every rank that recorded the value recorded the same one."""
    present = [v for v in values if v is not None]
    return len(present) >= 1 and all(close(v, present[0]) for v in present[1:])


def _whose(key: str, values: list, world: int, number=fmt) -> str:
    if agree(values):
        return f"{key} {number(values[0])} on {world} ranks"
    others = ", ".join(f"rank {r}: {number(v)}" for r, v in enumerate(values) if r and v is not None)
    return f"{key} {number(values[0])} on rank 0 ({others})"


def versus(key: str, values: list, single: float, world: int, number=fmt) -> tuple[str, list[Claim]]:
    """'<key> <v> on N ranks vs <s> on 1 device' (or 'on rank 0 (rank 1: ...)') and its claims:
    whose value it is, and that it differs from the one-device value."""
    text = f"{_whose(key, values, world, number)} vs {number(single)} on 1 device"
    facts = {f"{r}": v for r, v in enumerate(values)}
    return text, [claim("rank-value", text, rank=0, values=facts, reference=single),
                  claim("differ", text, values={"rank 0": values[0], "1 device": single}, against="reference",
                        rel=1e-6)]


def equals(key: str, values: list, single: float, world: int, number=fmt) -> tuple[str, list[Claim]]:
    """'<key> <v> on N ranks = <s> on 1 device' and its claims (the same value both ways)."""
    text = f"{_whose(key, values, world, number)} = {number(single)} on 1 device"
    facts = {f"{r}": v for r, v in enumerate(values)}
    return text, [claim("rank-value", text, rank=0, values=facts, reference=single),
                  claim("equal", text, values={"rank 0": values[0], "1 device": single}, against="reference",
                        rel=1e-4)]


def equal_list(same: list[tuple], world: int, limit: int = 4) -> tuple[str, list[Claim]]:
    """'a 0.5 on 2 ranks = 0.5 on 1 device, b ...' for ``same`` = [(key, [value per rank], single)]."""
    texts, made = [], []
    for key, values, single in same[:limit]:
        text, found = equals(key, values, single, world)
        texts.append(text)
        made += found
    return ", ".join(texts), made


def difference_origin(values: list, own: list[int], synced: bool) -> str:
    """Where the difference of a value from the one-device value comes from, as far as the run shows:
    a synced value (equal on every rank) counts every rank's samples, the duplicated ones twice; an
    unsynced one is rank 0's shard alone, which holds a duplicated sample twice only where rank 0's
    own indices ``own`` repeat one."""
    if synced:
        return "a value every rank shares, so the difference is the duplicated samples' extra weight"
    repeated = len(own) - len(set(own))
    if repeated:
        return (f"rank 0's own value (not synced): the difference is rank 0's shard alone, within which "
                f"{repeated} sample(s) are evaluated twice")
    return ("rank 0's own value (not synced): the difference is rank 0's shard alone (rank-local), not the "
            "duplicated samples, which no rank's own shard holds twice")


def published_equal(same: list[tuple], world: int, limit: int = 4) -> tuple[str, list[Claim]]:
    """'the published values equal the single-device ones (<equal_list>)' and its claims."""
    values, made = equal_list(same, world, limit)
    text = f"the published values equal the single-device ones ({values})"
    pairs = [{"rank 0": vals[0], "1 device": single} for _, vals, single in same[:limit]]
    return text, made + [claim("equal", text, each=pairs, against="reference", rel=1e-4)]


def _bad_word(values: list) -> str:
    bad = [v for v in values if v is not None and not math.isfinite(v)]
    if all(math.isnan(v) for v in bad):
        return "NaN"
    return "inf" if not any(math.isnan(v) for v in bad) else "NaN/inf"


def not_finite(entries: list[tuple], world: int, limit: int = 4) -> tuple[str, list[Claim]]:
    """'<key> is not judged, because the value is NaN on 2 ranks and on 1 device' for ``entries`` =
    [(key, [value per rank], one-device value)] with a NaN or inf among them: a comparison with such a
    value compares nothing, so the key is neither equal nor different. Its claim (kind 'not-finite')
    carries every value compared."""
    texts, made = [], []
    for key, values, single in entries[:limit]:
        ranks = [r for r, v in enumerate(values) if v is not None and not math.isfinite(v)]
        where = [f"{len(ranks)} ranks" if len(ranks) == world and world > 1 else
                 ("rank " if len(ranks) == 1 else "ranks ") + " and ".join(map(str, ranks))] if ranks else []
        if not math.isfinite(single):
            where.append("1 device")
        word = _bad_word([*values, single])
        text = f"{key} is not judged, because the value is {word} on {' and on '.join(where)}"
        if ranks and len(ranks) < len([v for v in values if v is not None]):
            text += " (" + ", ".join(f"rank {r}: {fmt(v)}" for r, v in enumerate(values)
                                     if v is not None and r not in ranks) + ")"
        if math.isfinite(single):
            text += f" ({fmt(single)} on 1 device)"
        texts.append(text)
        made.append(claim("not-finite", text, values={**{f"rank {r}": v for r, v in enumerate(values)},
                                                      "1 device": single}))
    more = f" (and {len(entries) - limit} more)" if len(entries) > limit else ""
    return "; ".join(texts) + more, made
