"""Judge chosen (case, contract, strategy) items of several conformance cases in one world pool.

    python tests/judge_items.py OUT.json CASE.py:contract[strategy] ...

What a pytest run of the plugin does per item (LtconformSession.verdict), but for several targets in
one process, so that end-to-end tests of the costly DeepSpeed tier pay for one cold world start. Writes
``[{"case", "item", "outcome", "message", "notes", "seconds"}]``.
"""

from __future__ import annotations

import json
import re
import sys
import time


def main(out: str, specs: list[str]) -> None:
    from pytest_ltconform.session import LtconformSession
    from pytest_ltconform.settings import Settings
    from pytest_ltconform.target import validation as target_validation
    from pytest_ltconform.world import WorldPool

    pool = WorldPool()
    rows = []
    sessions: dict[str, LtconformSession] = {}
    try:
        for spec in specs:
            path, contract, strategy = re.fullmatch(r"(.+\.py):([\w-]+)\[(\w+)\]", spec).groups()
            if path not in sessions:
                targets = target_validation.validate(f"{path}:Model", None, f"{path}:trainer_kwargs")
                sessions[path] = LtconformSession(Settings(target=path, timeout_s=60.0), targets, pool=pool)
            started = time.monotonic()
            verdict, _ = sessions[path].verdict(contract, strategy)
            rows.append({"case": path, "item": f"{contract}[{strategy}]", "outcome": verdict.outcome,
                         "message": verdict.render(), "notes": verdict.notes,
                         "seconds": round(time.monotonic() - started, 1)})
    finally:
        pool.close()
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
