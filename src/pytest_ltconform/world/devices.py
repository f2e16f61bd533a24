"""What accelerators this process can see. Imports torch only when asked."""

from __future__ import annotations


def cuda_device_count() -> int:
    """CUDA devices visible to this process (0 where torch has no CUDA build)."""
    try:
        import torch
    except ImportError:
        return 0
    try:
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:
        return 0
