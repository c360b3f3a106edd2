"""Gemma 4: MLX-format checkpoints, the feed-forward layer, synthetic weights."""
from __future__ import annotations

import os
from typing import Any, Optional

from . import _core
from ._arrays import error, from_core, stream_of, to_core
from ._moe import MoeWeights

# Synthetic geometries: the real 26B-A4B one, and the small one `expertqmm write-checkpoint --preset
# tiny` writes (tools/expertqmm/cmd_checkpoint.cpp), for tests and examples.
PRESETS = {
    "gemma4-26b-a4b": {},
    "tiny": {"hidden_size": 128, "intermediate_size": 192, "moe_intermediate_size": 64, "num_experts": 8,
             "top_k_experts": 2},
}


def gemma4_config(preset: str = "gemma4-26b-a4b", layers: int = 1, group_size: int = 64) -> _core.Gemma4Config:
    """A Gemma4Config of a preset ('gemma4-26b-a4b' or 'tiny'): the 26B-A4B quantization (experts 4-bit),
    ``layers`` layers, the experts' group size ``group_size``."""
    if preset not in PRESETS:
        raise error("gemma4_config", f"unknown preset '{preset}' ({', '.join(PRESETS)})")
    config = _core.Gemma4Config.gemma4_26b_a4b(layers)
    config.group_size = group_size
    for key, value in PRESETS[preset].items():
        setattr(config, key, value)
    return config


def synthetic_gemma4_layer(preset: str = "tiny", layer: int = 0, seed: int = 1,
                           config: Optional[_core.Gemma4Config] = None) -> _core.Gemma4Layer:
    """Deterministic synthetic weights of one layer (on the CPU; ``.to('cuda')`` copies), of ``config``
    or of the preset's geometry."""
    return _core.synthetic_gemma4_layer(config or gemma4_config(preset, layer + 1), layer, seed)


def write_synthetic_checkpoint(path: str, preset: str = "tiny", layers: int = 2, seed: int = 1,
                               group_size: int = 64, shards: int = 1, force: bool = False) -> str:
    """Write a synthetic MLX-format Gemma 4 checkpoint (config.json, safetensors) to ``path`` (absent or
    empty unless ``force``); returns ``path``. The 26B-A4B preset is ~0.45 GB a layer."""
    _core.write_synthetic_gemma4_checkpoint(os.fspath(path), gemma4_config(preset, layers, group_size), shards, seed,
                                            "model.", force)
    return os.fspath(path)


class Gemma4Checkpoint:
    """An MLX-format Gemma 4 checkpoint (mlx-lm layout; sharded or not), memory-mapped and validated up
    front: every file and feed-forward tensor is checked against config.json when it is opened."""

    def __init__(self, path: str) -> None:
        self.core = _core.Gemma4Checkpoint.open(os.fspath(path))

    @property
    def config(self) -> _core.Gemma4Config:
        """The config.json keys the feed-forward part uses."""
        return self.core.config

    @property
    def num_layers(self) -> int:
        """Layers in the checkpoint."""
        return self.core.num_layers

    @property
    def prefix(self) -> str:
        """The tensor-name prefix ('model.' or 'language_model.model.')."""
        return self.core.prefix

    def layer(self, layer: int, device: str = "cpu", device_id: int = 0) -> _core.Gemma4Layer:
        """Layer ``layer``'s feed-forward weights: CPU views of the mapping, or a copy on 'cuda'."""
        weights = self.core.layer(layer)
        return weights if device == "cpu" else weights.to(device, device_id)

    def moe_weights(self, layer: int, device: str = "cpu", device_id: int = 0) -> MoeWeights:
        """Layer ``layer``'s MoE block weights (router and experts)."""
        return MoeWeights.from_core(self.layer(layer, device, device_id).moe)

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds the tensor ``name``."""
        return self.core.has(name)

    def tensor(self, name: str, like: Any = None) -> Any:
        """The tensor ``name`` (a zero-copy view of the mapping): numpy by default (bfloat16 as
        ml_dtypes.bfloat16), or in the framework of ``like``."""
        import numpy as np

        return from_core(self.core.tensor(name), np.empty(0) if like is None else like)


def gemma4_ffn(h: Any, weights: _core.Gemma4Layer, *, out: Any = None, workspace: Optional[_core.Workspace] = None,
               stream: Optional[int] = None) -> Any:
    """The feed-forward part of a Gemma 4 MoE decoder layer (norms, dense GeGLU MLP, router, experts,
    residual, layer_scalar): h [T, H] (the post-attention residual) -> [T, H] in h's dtype.

    With ``out`` and a ``workspace`` it writes into ``out`` (no allocation or host sync on CUDA once the
    workspace has seen this T); runs on the caller's stream.
    """
    s = stream_of(h, stream)
    if out is None:
        return from_core(_core.gemma4_ffn(to_core(h), weights, s), h)
    _core.gemma4_ffn_into(to_core(out, writable=True), to_core(h), weights,
                          workspace if workspace is not None else _core.Workspace(), s)
    return out
