"""Rank side: the keys a DataLoader's sampler hands each fetch, read where the iterator draws them
(``_BaseDataLoaderIter._next_index``, in the main process whatever the workers), so what a stage
really fetched is read at its source. Shared by data-sharding (training samples) and
eval-duplication (evaluation samples). Imports nothing of torch at module level.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def tap(recorder: Any, record: Callable[[Any, Any], None]) -> None:
    """Call ``record(iterator, index)`` with every index (a key, or a list of keys for a batch
    sampler) a DataLoader iterator draws while ``recorder``'s patches are installed. A key that
    ``record`` cannot read is skipped: the user's loop never sees the tap fail."""
    from torch.utils.data import dataloader

    def wrap(original):
        def _next_index(it):
            index = original(it)
            try:
                record(it, index)
            except Exception:
                pass  # a key that cannot be read is not recorded
            return index

        return _next_index

    recorder.patch(dataloader._BaseDataLoaderIter, "_next_index", wrap)
