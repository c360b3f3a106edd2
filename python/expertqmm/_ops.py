"""The MLX ops: quantize, dequantize, gather_qmm, gather_mm (shared/spec/mlx-semantics.md)."""
from __future__ import annotations

from typing import Any, Optional, Tuple

from . import _core
from ._arrays import from_core, narrow_indices, optional_core, stream_of, to_core


def quantize(w: Any, bits: Optional[int] = None, group_size: Optional[int] = None, rounding: str = "cpu",
             mode: str = "affine", global_scale: Any = None, *, stream: Optional[int] = None) -> Tuple[Any, Any, Any]:
    """``mx.quantize(w, group_size, bits, mode, global_scale)``, bit-exact with MLX.

    w: float [..., N, K], K a multiple of the group size. ``mode``: 'affine' (bits 4 and group 64 unless
    given) or MLX's fp modes 'mxfp4', 'mxfp8', 'nvfp4' (their own bits and group size; ``global_scale``:
    nvfp4's optional float32 scalar). ``rounding`` (affine): 'cpu' (MLX's CPU backend: exact min/max, ties
    to even) or 'gpu' (MLX's Metal/CUDA backends). Returns ``(w_q, scales, biases)``: uint32
    [..., N, K*bits/32], scales [..., N, K/group_size] (w's dtype; uint8 in the fp modes), biases like
    the scales (affine) or None, in w's framework.
    """
    q = _core.quantize(to_core(w), bits, group_size, rounding, mode, optional_core(global_scale), stream_of(w, stream))
    return tuple(None if t is None else from_core(t, w) for t in q)


def dequantize(w: Any, scales: Any, biases: Any, group_size: Optional[int] = None, bits: Optional[int] = None,
               mode: str = "affine", global_scale: Any = None, dtype: Optional[str] = None, *,
               stream: Optional[int] = None) -> Any:
    """``mx.dequantize``: [..., N, K]. Affine: ``scales * q + biases`` in the scales' dtype (bits 4 and
    group 64 unless given). MLX's fp modes ('mxfp4', 'mxfp8', 'nvfp4'; ``biases`` None): the decoded
    values in bfloat16, or float32 with nvfp4's ``global_scale``. ``dtype`` ('bfloat16', 'float16',
    'float32') picks another output dtype."""
    out = _core.dequantize(to_core(w), to_core(scales), optional_core(biases), group_size, bits, mode,
                           optional_core(global_scale), dtype, stream_of(w, stream))
    return from_core(out, w if biases is None else scales)


def gather_qmm(x: Any, w: Any, scales: Any, biases: Any, lhs_indices: Any = None, rhs_indices: Any = None,
               transpose: bool = True, group_size: int = 64, bits: int = 4, sorted_indices: bool = False,
               mode: str = "affine", *, stream: Optional[int] = None) -> Any:
    """``mx.gather_qmm``: x [*Bx, M, K] times the quantized w [*Bw, N, K*bits/32] (transpose) picked by the
    indices (None: every batch in order), output S + [M, N] in promote(x, scales) (affine) or x's dtype.

    ``mode``: 'affine', or one of MLX's fp modes 'mxfp4', 'mxfp8', 'nvfp4' (uint8 scales, ``biases``
    None). ``sorted_indices`` is a promise that is checked, never trusted. int64 indices are narrowed
    to int32.
    """
    out = _core.gather_qmm(to_core(x), to_core(w), to_core(scales), optional_core(biases),
                           optional_core(narrow_indices(lhs_indices)), optional_core(narrow_indices(rhs_indices)),
                           transpose, group_size, bits, sorted_indices, mode, stream_of(x, stream))
    return from_core(out, x)


def gather_mm(a: Any, b: Any, lhs_indices: Any = None, rhs_indices: Any = None, sorted_indices: bool = False, *,
              stream: Optional[int] = None) -> Any:
    """``mx.gather_mm`` (16-bit experts): a [*Ba, M, K] times b [*Bb, K, N] (any strides, e.g. a transposed
    [E, N, K] weight), output S + [M, N] in promote(a, b), fp32 accumulation."""
    out = _core.gather_mm(to_core(a), to_core(b), optional_core(narrow_indices(lhs_indices)),
                          optional_core(narrow_indices(rhs_indices)), sorted_indices, stream_of(a, stream))
    return from_core(out, a)
