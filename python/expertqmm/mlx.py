"""expertqmm inside MLX: custom MLX primitives and a patch for mlx-lm models.

    import expertqmm.mlx
    expertqmm.mlx.patch(model)      # an mlx-lm model: its MoE layers now run on expertqmm

The primitives are MLX graph nodes (lazy, ``mx.eval`` runs them): on a CUDA stream they launch
expertqmm's kernels on MLX's stream inside MLX's own CUDA graph; on the CPU they run expertqmm's
CPU backend (the bit-exact reference). Cases they do not take (fp quantization modes, 2/3/5/6-bit,
transpose=False, biases on the projections) go to MLX's own ops unchanged.

``patch`` swaps the class of the MoE modules it finds (Gemma 4's router and experts, Qwen3-MoE's
sparse block, any other SwitchGLU) for a subclass whose ``__call__`` calls the primitives: the
parameters, their names and the module tree stay as they are (no copy, no re-quantization), and
``unpatch`` puts the classes back.

Build: the extension ``expertqmm._mlx`` is built by ``pip install --no-build-isolation .`` when
``mlx`` imports in the building Python (it links that install's libmlx).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

try:
    from . import _mlx
except ImportError as e:  # built without mlx importable: say how to get it
    raise ImportError(
        "expertqmm was built without its MLX extension (expertqmm._mlx): install mlx, then reinstall expertqmm "
        "with `pip install --no-build-isolation .` so the build sees it") from e

__all__ = ["gather_qmm", "switch_glu", "moe_block", "patch", "unpatch", "patched_modules", "supports_gather_qmm",
           "import_mlx_lm_models"]

_FLOAT_TYPES = (mx.bfloat16, mx.float16, mx.float32)


def supports_gather_qmm(x: mx.array, scales: mx.array, biases: Optional[mx.array], transpose: bool, bits: int,
                        mode: str) -> bool:
    """Whether ``gather_qmm`` runs on expertqmm: affine 4/8-bit with biases, transpose=True, x a float array
    of the scales' dtype (a mixed pair widens x first, which expertqmm does on the host: MLX's own op
    takes it, so the device path never syncs)."""
    return (mode == "affine" and transpose and bits in (4, 8) and biases is not None and x.dtype in _FLOAT_TYPES
            and x.dtype == scales.dtype and x.ndim >= 2)


def gather_qmm(x: mx.array, w: mx.array, scales: mx.array, biases: Optional[mx.array] = None,
               lhs_indices: Optional[mx.array] = None, rhs_indices: Optional[mx.array] = None, transpose: bool = True,
               group_size: int = 64, bits: int = 4, mode: str = "affine", sorted_indices: bool = False) -> mx.array:
    """``mx.gather_qmm`` with MLX's semantics; affine 4/8-bit transposed cases run on expertqmm."""
    if not supports_gather_qmm(x, scales, biases, transpose, bits, mode):
        return mx.gather_qmm(x, w, scales, biases, lhs_indices=lhs_indices, rhs_indices=rhs_indices,
                             transpose=transpose, group_size=group_size, bits=bits, mode=mode,
                             sorted_indices=sorted_indices)
    # MLX's defaults: each index array absent is the identity over its operand's batch.
    if lhs_indices is None:
        batch = x.shape[:-2]
        lhs_indices = mx.arange(math.prod(batch), dtype=mx.uint32).reshape(batch)
    if rhs_indices is None:
        batch = w.shape[:-2]
        rhs_indices = mx.arange(math.prod(batch), dtype=mx.uint32).reshape(batch)
    return _mlx.gather_qmm(x, w, scales, biases, lhs_indices, rhs_indices, group_size, bits, sorted_indices)


def import_mlx_lm_models() -> None:
    """Makes ``mlx_lm.models.*`` importable where ``import mlx_lm`` fails for want of transformers.

    mlx-lm's package ``__init__`` imports its loader and generator, which import transformers; its
    model files need only mlx. Where transformers is missing (a machine with no package registry),
    ``mlx_lm`` is registered as a bare namespace over its directory, so the model files still import.
    """
    import importlib.util
    import sys
    import types

    try:
        import mlx_lm  # noqa: F401
        return
    except ImportError:
        spec = importlib.util.find_spec("mlx_lm")
        if spec is None or not spec.submodule_search_locations:
            raise
    package = types.ModuleType("mlx_lm")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["mlx_lm"] = package


# --- mlx-lm modules -> the primitives' (arrays, spec) -------------------------------------------------

Projection = Tuple[bool, int, int]  # (quantized, group_size, bits)


def _linear(layer: Any) -> Optional[Tuple[List[mx.array], Projection]]:
    """The arrays and spec of a bias-free Linear / SwitchLinear, quantized (affine 4/8) or dense."""
    if "bias" in layer:
        return None
    if "scales" in layer:
        if getattr(layer, "mode", "affine") != "affine" or layer.bits not in (4, 8) or layer.get("biases") is None:
            return None
        if getattr(layer, "global_scale", None) is not None:
            return None
        return [layer["weight"], layer["scales"], layer["biases"]], (True, layer.group_size, layer.bits)
    if layer["weight"].dtype not in _FLOAT_TYPES:
        return None
    return [layer["weight"]], (False, 0, 0)


def _activation(switch_glu_module: Any) -> Optional[str]:
    """mlx-lm's GLU of a SwitchGLU: SwiGLU (switch_layers) or Gemma 4's GeGLU (gelu_approx(gate) * up)."""
    from mlx_lm.models import switch_layers

    act = switch_glu_module.activation
    if type(act) is switch_layers.SwiGLU:
        return "swiglu"
    try:
        from mlx_lm.models import gemma4_text
    except ImportError:
        return None
    return "geglu" if type(act) is gemma4_text.GeGLU else None


@dataclass
class _Experts:
    arrays: List[mx.array]
    projections: List[Projection]
    activation: str

    def takes(self, x: mx.array) -> bool:
        """Whether x is in every projection's float dtype (scales', or a 16-bit weight's). A mixed call
        widens x first, which expertqmm does on the host: it stays with mlx-lm's own code instead."""
        at, dtypes = 0, set()
        for quantized, _, _ in self.projections:
            dtypes.add(self.arrays[at + (1 if quantized else 0)].dtype)
            at += 3 if quantized else 1
        return dtypes == {x.dtype}


def _experts(switch_glu_module: Any) -> Optional[_Experts]:
    act = _activation(switch_glu_module)
    parts = [_linear(getattr(switch_glu_module, n)) for n in ("gate_proj", "up_proj", "down_proj")]
    if act is None or any(p is None for p in parts):
        return None
    return _Experts([a for arrays, _ in parts for a in arrays], [spec for _, spec in parts], act)


def switch_glu(x: mx.array, indices: mx.array, switch_glu_module: Any) -> mx.array:
    """mlx-lm's ``SwitchGLU(x, indices)`` on expertqmm: x [..., D], indices [..., k] -> [..., k, D]."""
    e = _experts(switch_glu_module)
    if e is None:
        raise ValueError(f"expertqmm.mlx.switch_glu: {type(switch_glu_module).__name__} has projections or an "
                         "activation expertqmm does not take (affine 4/8-bit or 16-bit, no bias; SwiGLU or GeGLU)")
    d, k = x.shape[-1], indices.shape[-1]
    y = _mlx.switch_glu(x.reshape(-1, d), indices.reshape(-1, k), e.arrays, e.projections, e.activation)
    return y.reshape(*indices.shape, d)


def moe_block(h: mx.array, x: mx.array, router: List[mx.array], router_kind: str, router_projection: Projection,
              top_k: int, experts: _Experts, eps: float = 1e-6, norm_topk_prob: bool = True) -> mx.array:
    """The MoE block (expertqmm moe_layer): route h, run the experts on x, combine. h, x [..., H]."""
    shape = h.shape
    out = _mlx.moe_block(h.reshape(-1, shape[-1]), x.reshape(-1, shape[-1]), router, router_kind,
                         router_projection, top_k, eps, norm_topk_prob, experts.arrays, experts.projections,
                         experts.activation)
    return out.reshape(shape)


# --- the patched classes --------------------------------------------------------------------------

_ORIGINAL = "_expertqmm_original_class"
_PATCHED_CLASSES: dict = {}


def _patched_class(cls: type, call: Any) -> type:
    """A subclass of ``cls`` whose __call__ is ``call`` (one per original class)."""
    if cls not in _PATCHED_CLASSES:
        _PATCHED_CLASSES[cls] = type(f"Expertqmm{cls.__name__}", (cls,), {"__call__": call, "__module__": __name__})
    return _PATCHED_CLASSES[cls]


def _swap(module: Any, call: Any) -> None:
    cls = type(module)
    object.__setattr__(module, _ORIGINAL, cls)  # plain attribute, not an MLX child or parameter
    module.__class__ = _patched_class(cls, call)


def _original_call(module: Any, *args: Any) -> Any:
    """The module's own (mlx-lm) __call__, for calls the primitives do not take."""
    return getattr(module, _ORIGINAL).__call__(module, *args)


def _switch_glu_call(self: Any, x: mx.array, indices: mx.array) -> mx.array:
    if not _experts(self).takes(x):
        return _original_call(self, x, indices)
    return switch_glu(x, indices, self)


@dataclass
class _DeferredRoute:
    """What the patched Gemma 4 router returns in place of (indices, weights): its input and itself.
    The patched experts, which the decoder layer calls next with it, run the whole block at once."""
    h: mx.array
    router: Any


def _gemma4_router_call(self: Any, x: mx.array) -> Tuple[_DeferredRoute, None]:
    return _DeferredRoute(x, self), None


def _gemma4_experts_call(self: Any, x: mx.array, top_k_indices: Any, top_k_weights: Any) -> mx.array:
    experts = _experts(self.switch_glu)
    if not isinstance(top_k_indices, _DeferredRoute):  # called with a real routing: the experts alone
        if not experts.takes(x):
            return _original_call(self, x, top_k_indices, top_k_weights)
        y = switch_glu(x, top_k_indices, self.switch_glu)
        return (mx.expand_dims(top_k_weights, -1) * y).sum(-2)
    router, h = top_k_indices.router, top_k_indices.h
    proj_arrays, proj_spec = _linear(router.proj)
    if not experts.takes(x) or h.dtype != x.dtype:  # mlx-lm's own router and experts
        return _original_call(self, x, *_original_call(router, h))
    return moe_block(h, x, proj_arrays + [router["scale"], router["per_expert_scale"]], "gemma4", proj_spec,
                     router.config.top_k_experts, experts, eps=router.eps)


def _qwen3_moe_call(self: Any, x: mx.array) -> mx.array:
    if not _experts(self.switch_mlp).takes(x):
        return _original_call(self, x)
    proj_arrays, proj_spec = _linear(self.gate)
    return moe_block(x, x, proj_arrays, "softmax_topk", proj_spec, self.top_k, _experts(self.switch_mlp),
                     norm_topk_prob=self.norm_topk_prob)


def _gemma4_pairs(model: nn.Module):
    """(router, experts) of each Gemma 4 decoder layer with an MoE block."""
    for _, m in model.named_modules():
        router, experts = getattr(m, "router", None), getattr(m, "experts", None)
        if router is None or experts is None or not getattr(m, "enable_moe", False):
            continue
        if type(router).__name__ == "Router" and type(experts).__name__ == "Experts":
            yield router, experts


def patch(model: nn.Module) -> List[str]:
    """Runs the MoE layers of an mlx-lm ``model`` on expertqmm, in place; returns what it swapped.

    Gemma 4 decoder layers get the fused MoE block (router + experts + combine in one primitive),
    Qwen3-MoE sparse blocks too (softmax top-k router); any other SwitchGLU gets the SwitchGLU
    primitive. Layers whose weights expertqmm does not take (fp modes, biases, other activations) are
    left as they are. ``unpatch(model)`` undoes it.
    """
    from mlx_lm.models import switch_layers

    done: List[str] = []
    # The SwitchGLUs inside a fused block (patched now or by an earlier call) keep their class.
    fused_glus = {id(getattr(m, n)) for m in patched_modules(model) for n in ("switch_glu", "switch_mlp") if n in m}
    for router, experts in _gemma4_pairs(model):
        if _linear(router.proj) is None or _experts(experts.switch_glu) is None:
            continue
        _swap(router, _gemma4_router_call)
        _swap(experts, _gemma4_experts_call)
        fused_glus.add(id(experts.switch_glu))
        done.append("gemma4 moe block")
    for name, m in model.named_modules():
        if hasattr(m, _ORIGINAL):
            continue
        if type(m).__name__ == "Qwen3MoeSparseMoeBlock" and getattr(m, "sharding_group", None) is None:
            if _linear(m.gate) is not None and _experts(m.switch_mlp) is not None:
                _swap(m, _qwen3_moe_call)
                fused_glus.add(id(m.switch_mlp))
                done.append(f"{name}: qwen3_moe block")
    for name, m in model.named_modules():
        if (isinstance(m, switch_layers.SwitchGLU) and not hasattr(m, _ORIGINAL) and id(m) not in fused_glus
                and _experts(m) is not None):
            _swap(m, _switch_glu_call)
            done.append(f"{name}: switch_glu")
    return done


def patched_modules(model: nn.Module) -> List[Any]:
    """The modules ``patch`` swapped and ``unpatch`` would restore."""
    return [m for _, m in model.named_modules() if hasattr(m, _ORIGINAL)]


def unpatch(model: nn.Module) -> int:
    """Restores every module ``patch`` swapped; returns how many."""
    restored = patched_modules(model)
    for m in restored:
        m.__class__ = getattr(m, _ORIGINAL)
        object.__delattr__(m, _ORIGINAL)
    return len(restored)
