"""expertqmm: the expert path of quantized MoE LLMs (MLX semantics), on NVIDIA GPUs and any CPU.

Arrays in and out are zero-copy (DLPack, buffers): numpy (bfloat16 as ml_dtypes.bfloat16), torch
(CPU and CUDA; CUDA work runs on torch's current stream), or any DLPack producer. Results come back
in the framework of the op's first array. Failures raise ``expertqmm.Error`` naming the op.

    import expertqmm, torch
    q = expertqmm.quantize(w)                              # (w, scales, biases), MLX bit-exact
    y = expertqmm.gather_qmm(x, *q, rhs_indices=idx)       # mx.gather_qmm
    ck = expertqmm.Gemma4Checkpoint(path)
    out = expertqmm.gemma4_ffn(h, ck.layer(0))             # Gemma 4 feed-forward part

``expertqmm.torch`` has the ops as torch.library custom ops and an nn.Module for the MoE block.
"""
from __future__ import annotations

from typing import Any

from . import diagnostics, settings
from ._core import Error, Gemma4Config, Gemma4Layer, Quantized, Tensor, Workspace
from ._core import cuda_available, cuda_built, cuda_check, cuda_device_name
from ._gemma4 import (Gemma4Checkpoint, gemma4_config, gemma4_ffn, synthetic_gemma4_layer,
                      write_synthetic_checkpoint)
from ._moe import MoeWeights, moe_layer, route
from ._ops import dequantize, gather_mm, gather_qmm, quantize

__version__ = "0.1.0"

__all__ = [
    "Error", "Tensor", "Workspace", "Quantized", "MoeWeights", "Gemma4Checkpoint", "Gemma4Config", "Gemma4Layer",
    "quantize", "dequantize", "gather_qmm", "gather_mm", "route", "moe_layer", "gemma4_ffn", "gemma4_config",
    "synthetic_gemma4_layer", "write_synthetic_checkpoint", "diagnostics", "settings", "cuda_built",
    "cuda_available", "cuda_device_name", "cuda_check", "bfloat16",
]


def __getattr__(name: str) -> Any:
    """``expertqmm.bfloat16``: numpy's bfloat16 dtype (ml_dtypes), imported on first use."""
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    raise AttributeError(f"module 'expertqmm' has no attribute '{name}'")
