"""Route counters per primitive (include/expertqmm/diagnostics.h): how often each CUDA route served a
call and why it fell back. Invariant: attempts == hits + sum(fallbacks.values())."""
from __future__ import annotations

from typing import Any, Dict, List

from . import _core


def snapshot() -> List[Dict[str, Any]]:
    """The counters: one dict per primitive with primitive, attempts, requested, available, hits and
    fallbacks ({class: count}). Synchronizes the CUDA stream (device verdicts are folded in)."""
    return _core.diagnostics_snapshot()


def reset() -> None:
    """Zero every counter."""
    _core.diagnostics_reset()


def format() -> str:  # noqa: A001 - the C++ name
    """The counters as a table for humans."""
    return _core.diagnostics_format()
