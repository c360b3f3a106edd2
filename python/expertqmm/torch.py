"""expertqmm for PyTorch: the ops as ``torch.library`` custom ops (``torch.ops.expertqmm.*``, with fake
implementations, so ``torch.compile`` traces through them) and ``nn.Module``s for the MoE block and
the Gemma 4 feed-forward layer.

The layer ops take their weights as a handle (an int from ``register_moe_weights`` /
``register_gemma4_layer``; the modules do this for you): a Gemma 4 MoE block has a dozen weight
tensors, and the handle keeps the per-call cost to the activations. Each handle owns a Workspace, so
after one call at a token count, calls at or below it allocate nothing outside torch's allocator and
never synchronize the host: they can be captured in a CUDA graph (``torch.cuda.graph``) or run under
``torch.compile(mode="reduce-overhead")``. Work runs on torch's current stream.
"""
import itertools
import weakref
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
from torch import nn

from . import _core
from ._arrays import error, stream_of, to_core
from ._gemma4 import Gemma4Checkpoint
from ._moe import MLX_NAMES, MoeWeights, mlx_tensor_names

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}


def _dtype_name(t: torch.dtype) -> str:
    if t not in _DTYPES:
        raise error("torch", f"activations must be bfloat16, float16 or float32, got {t}")
    return _DTYPES[t]


def _promote(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """MLX's promotion over the float types expertqmm carries: equal stays, anything else is float32."""
    return a if a == b else torch.float32


# ---------------------------------------------------------------- weight handles
class _Registered:
    """A layer's weights (a _core.MoeWeights or Gemma4Layer), its Workspace and what keeps them alive."""

    def __init__(self, weights: Any, keep: Any) -> None:
        self.weights = weights
        self.workspace = _core.Workspace()
        self.keep = keep


_REGISTRY: Dict[int, _Registered] = {}
_NEXT_HANDLE = itertools.count(1)


def register_moe_weights(weights: MoeWeights) -> int:
    """A handle for ``weights`` (held until ``release``), for ``torch.ops.expertqmm.moe_layer``."""
    handle = next(_NEXT_HANDLE)
    _REGISTRY[handle] = _Registered(weights.core, weights)
    return handle


def register_gemma4_layer(layer: _core.Gemma4Layer) -> int:
    """A handle for a Gemma 4 layer's weights, for ``torch.ops.expertqmm.gemma4_ffn``."""
    handle = next(_NEXT_HANDLE)
    _REGISTRY[handle] = _Registered(layer, None)
    return handle


def release(handle: int) -> None:
    """Drop a handle's weights and workspace."""
    _REGISTRY.pop(handle, None)


def _registered(handle: int) -> _Registered:
    if handle not in _REGISTRY:
        raise error("torch", f"no weights are registered under handle {handle} (released?)")
    return _REGISTRY[handle]


# ---------------------------------------------------------------- custom ops
@torch.library.custom_op("expertqmm::quantize", mutates_args=())
def quantize(w: torch.Tensor, bits: int = 4, group_size: int = 64,
             rounding: str = "cpu") -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mx.quantize``: (uint32 codes [..., N, K*bits/32], scales, biases [..., N, K/group_size])."""
    from . import _ops

    return _ops.quantize(w.contiguous(), bits, group_size, rounding)


@quantize.register_fake
def _(w, bits=4, group_size=64, rounding="cpu"):
    *lead, n, k = w.shape
    groups = (*lead, n, k // group_size)
    return (w.new_empty((*lead, n, k * bits // 32), dtype=torch.uint32), w.new_empty(groups), w.new_empty(groups))


@torch.library.custom_op("expertqmm::dequantize", mutates_args=())
def dequantize(w: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group_size: int = 64,
               bits: int = 4) -> torch.Tensor:
    """``mx.dequantize``: [..., N, K] in the scales' dtype."""
    from . import _ops

    return _ops.dequantize(w, scales, biases, group_size, bits)


@dequantize.register_fake
def _(w, scales, biases, group_size=64, bits=4):
    return scales.new_empty((*w.shape[:-1], w.shape[-1] * 32 // bits))


def _batch_shape(indices: Optional[torch.Tensor], batch: Tuple[int, ...]) -> Tuple[int, ...]:
    return tuple(indices.shape) if indices is not None else tuple(batch)


@torch.library.custom_op("expertqmm::gather_qmm", mutates_args=())
def gather_qmm(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor,
               lhs_indices: Optional[torch.Tensor] = None, rhs_indices: Optional[torch.Tensor] = None,
               transpose: bool = True, group_size: int = 64, bits: int = 4,
               sorted_indices: bool = False) -> torch.Tensor:
    """``mx.gather_qmm``: S + [M, N] in promote(x, scales)."""
    from . import _ops

    return _ops.gather_qmm(x, w, scales, biases, lhs_indices, rhs_indices, transpose, group_size, bits,
                           sorted_indices)


@gather_qmm.register_fake
def _(x, w, scales, biases, lhs_indices=None, rhs_indices=None, transpose=True, group_size=64, bits=4,
      sorted_indices=False):
    s = torch.broadcast_shapes(_batch_shape(lhs_indices, x.shape[:-2]), _batch_shape(rhs_indices, w.shape[:-2]))
    n = w.shape[-2] if transpose else w.shape[-1] * 32 // bits
    return x.new_empty((*s, x.shape[-2], n), dtype=_promote(x.dtype, scales.dtype))


@torch.library.custom_op("expertqmm::gather_mm", mutates_args=())
def gather_mm(a: torch.Tensor, b: torch.Tensor, lhs_indices: Optional[torch.Tensor] = None,
              rhs_indices: Optional[torch.Tensor] = None, sorted_indices: bool = False) -> torch.Tensor:
    """``mx.gather_mm``: S + [M, N] in promote(a, b)."""
    from . import _ops

    return _ops.gather_mm(a, b, lhs_indices, rhs_indices, sorted_indices)


@gather_mm.register_fake
def _(a, b, lhs_indices=None, rhs_indices=None, sorted_indices=False):
    s = torch.broadcast_shapes(_batch_shape(lhs_indices, a.shape[:-2]), _batch_shape(rhs_indices, b.shape[:-2]))
    return a.new_empty((*s, a.shape[-2], b.shape[-1]), dtype=_promote(a.dtype, b.dtype))


@torch.library.custom_op("expertqmm::moe_layer", mutates_args=())
def moe_layer(h: torch.Tensor, x: torch.Tensor, weights: int) -> torch.Tensor:
    """The MoE block (route h, experts on x, combine) with the weights of handle ``weights``: [T, H]."""
    r = _registered(weights)
    h, x = h.contiguous(), x.contiguous()
    out = torch.empty(h.shape, dtype=_TORCH_DTYPES[r.weights.output_dtype(_dtype_name(x.dtype))], device=h.device)
    _core.moe_layer_into(to_core(out, writable=True), to_core(h), to_core(x), r.weights, r.workspace,
                         stream_of(h, None))
    return out


@moe_layer.register_fake
def _(h, x, weights):
    return h.new_empty(h.shape, dtype=_TORCH_DTYPES[_registered(weights).weights.output_dtype(_dtype_name(x.dtype))])


@torch.library.custom_op("expertqmm::gemma4_ffn", mutates_args=())
def gemma4_ffn(h: torch.Tensor, weights: int) -> torch.Tensor:
    """The Gemma 4 feed-forward part with the layer of handle ``weights``: [T, H] in h's dtype."""
    r = _registered(weights)
    h = h.contiguous()
    out = torch.empty_like(h)
    _core.gemma4_ffn_into(to_core(out, writable=True), to_core(h), r.weights, r.workspace, stream_of(h, None))
    return out


@gemma4_ffn.register_fake
def _(h, weights):
    return torch.empty_like(h)


# ---------------------------------------------------------------- modules
class MoeBlock(nn.Module):
    """The expert half of a Gemma 4 MoE block (router, SwitchGLU experts, weighted combine) on
    expertqmm's kernels. Its buffers carry mlx-lm's names ('router.proj.weight', '.scales', '.biases',
    'router.scale', 'router.per_expert_scale', 'experts.switch_glu.gate_proj.weight', ...), so
    ``state_dict()`` is an MLX layer's MoE tensors; ``.to('cuda')`` moves them.

    ``forward(h, x=None)``: h [T, H] routes, x (default h) feeds the experts.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], top_k: int = 8, eps: float = 1e-6,
                 activation: str = "geglu") -> None:
        super().__init__()
        self.top_k, self.eps, self.activation = top_k, eps, activation
        for name, t in tensors.items():
            module = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, nn.Module())
                module = getattr(module, part)
            module.register_buffer(leaf, t)
        self._handle = self._register()

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, torch.Tensor], prefix: str = "", *, top_k: int = 8,
                        eps: float = 1e-6, activation: str = "geglu") -> "MoeBlock":
        """From a state dict holding one layer's MoE tensors under ``prefix`` (mlx-lm names, e.g.
        prefix='model.layers.3.'). Projections with '.scales' are MLX-quantized, else dense float."""
        return cls(mlx_tensor_names(state_dict, prefix), top_k=top_k, eps=eps, activation=activation)

    @classmethod
    def from_mlx_checkpoint(cls, path: str, layer: int, device: Optional[torch.device] = None) -> "MoeBlock":
        """Layer ``layer`` of an MLX-format Gemma 4 checkpoint (top_k and eps from its config)."""
        ck = Gemma4Checkpoint(path)
        prefix = f"{ck.prefix}layers.{layer}."
        names = [f"{m}.{p}" for m in MLX_NAMES.values() for p in ("weight", "scales", "biases")]
        names += ["router.scale", "router.per_expert_scale"]
        like = torch.empty(0)
        # clone: the checkpoint's mapping is read-only and closes with `ck`.
        tensors = {n: ck.tensor(prefix + n, like=like).clone() for n in names if ck.has(prefix + n)}
        block = cls(tensors, top_k=ck.config.top_k_experts, eps=ck.config.rms_norm_eps)
        return block.to(device) if device is not None else block

    def _register(self) -> int:
        # Eagerly (at construction and after a move), so that forward only reads an int: torch.compile
        # then sees a constant, never the DLPack calls.
        weights = MoeWeights.from_mlx(dict(self.named_buffers()), top_k=self.top_k, eps=self.eps,
                                      activation=self.activation)
        handle = register_moe_weights(weights)
        weakref.finalize(self, release, handle)
        return handle

    def handle(self) -> int:
        """The registered handle of the current buffers (``torch.ops.expertqmm.moe_layer``'s third argument)."""
        return self._handle

    def _apply(self, fn, *args, **kwargs):
        result = super()._apply(fn, *args, **kwargs)
        if getattr(self, "_handle", None) is not None:  # the buffers moved or changed type: re-register the new ones
            release(self._handle)
            self._handle = self._register()
        return result

    def forward(self, h: torch.Tensor, x: Optional[torch.Tensor] = None) -> torch.Tensor:
        """h [T, H] -> [T, H] (x, default h, feeds the experts)."""
        return torch.ops.expertqmm.moe_layer(h, h if x is None else x, self.handle())


class Gemma4FeedForward(nn.Module):
    """The feed-forward part of a Gemma 4 MoE decoder layer (``expertqmm.gemma4_ffn``) as a module.
    Its weights live in the library (a checkpoint layer copied to ``device``), not in torch buffers."""

    def __init__(self, layer: _core.Gemma4Layer) -> None:
        super().__init__()
        self.layer = layer
        self._handle = register_gemma4_layer(layer)
        weakref.finalize(self, release, self._handle)

    @classmethod
    def from_mlx_checkpoint(cls, path: str, layer: int, device: str = "cpu", device_id: int = 0) -> "Gemma4FeedForward":
        """Layer ``layer`` of an MLX-format checkpoint, on 'cpu' (mapped) or 'cuda' (copied)."""
        return cls(Gemma4Checkpoint(path).layer(layer, device, device_id))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, H] (the post-attention residual) -> [T, H]."""
        return torch.ops.expertqmm.gemma4_ffn(h, self._handle)
