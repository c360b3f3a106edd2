"""Framework arrays in and out of expertqmm._core, zero-copy.

In: anything with ``__dlpack__`` or the buffer protocol; torch tensors go through
``torch.utils.dlpack.to_dlpack`` (a plain capsule: ``Tensor.__dlpack__()`` would make the legacy
default stream wait on the current one, which a CUDA graph capture forbids); numpy bfloat16 arrays
(``ml_dtypes.bfloat16``) as their uint16 bits. Out: the framework of the op's first array (torch,
numpy), else an ``expertqmm.Tensor``, which any DLPack consumer takes.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

import numpy as np

from . import _core


def _torch_module():
    """torch if it is already imported (an array can only be a torch tensor then); never imports it."""
    return sys.modules.get("torch")


def is_torch(a: Any) -> bool:
    """Whether ``a`` is a torch.Tensor (without importing torch)."""
    torch = _torch_module()
    return torch is not None and isinstance(a, torch.Tensor)


def to_core(a: Any, writable: bool = False) -> _core.Tensor:
    """A zero-copy ``_core.Tensor`` view of ``a``."""
    if isinstance(a, _core.Tensor):
        return a
    if is_torch(a):
        return _core.Tensor.wrap(_torch_module().utils.dlpack.to_dlpack(a.detach()), writable=writable)
    if isinstance(a, np.ndarray) and a.dtype.name == "bfloat16":  # ml_dtypes.bfloat16
        return _core.Tensor.wrap(a.view(np.uint16), dtype="bfloat16", writable=writable)
    return _core.Tensor.wrap(a, writable=writable)


def optional_core(a: Any) -> Optional[_core.Tensor]:
    """``to_core`` for an optional argument."""
    return None if a is None else to_core(a)


def from_core(t: _core.Tensor, like: Any) -> Any:
    """``t`` in the framework of ``like`` (torch, numpy), else ``t`` itself (a DLPack producer)."""
    if is_torch(like):
        return _torch_module().utils.dlpack.from_dlpack(t.ndarray().__dlpack__())
    if isinstance(like, np.ndarray):
        if t.dtype == "bfloat16":
            import ml_dtypes

            return np.from_dlpack(t.ndarray(bits_only=True)).view(ml_dtypes.bfloat16)
        return np.from_dlpack(t.ndarray())
    return t


def stream_of(a: Any, stream: Optional[int]) -> int:
    """The CUDA stream to run on: ``stream`` when given, else torch's current stream for a torch CUDA
    tensor, else 0 (the legacy default stream)."""
    if stream is not None:
        return int(stream)
    if is_torch(a) and a.is_cuda:
        return _torch_module().cuda.current_stream(a.device).cuda_stream
    return 0


def narrow_indices(a: Any) -> Any:
    """int64 index arrays (torch.topk, numpy's default) as int32; expertqmm takes 32-bit indices."""
    if a is None:
        return None
    if is_torch(a):
        torch = _torch_module()
        return a.to(torch.int32) if a.dtype == torch.int64 else a
    if isinstance(a, np.ndarray) and a.dtype == np.int64:
        return a.astype(np.int32)
    return a


def error(op: str, message: str) -> _core.Error:
    """An ``expertqmm.Error`` raised by the Python layer, worded as the library's: 'expertqmm::op: message'."""
    e = _core.Error(f"expertqmm::{op}: {message}")
    e.op = op
    return e
