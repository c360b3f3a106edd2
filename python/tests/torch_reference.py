"""A plain-torch reference of the Gemma 4 MoE block over MLX weights (mlx-lm names), written from the
spec (shared/spec/mlx-semantics.md, gemma4-moe.md): dequantize, router, SwitchGLU in bf16 (torch GEMMs),
fp32 weighted combine. The GPU tests and the Python bench compare expertqmm against it."""
import torch
import torch.nn.functional as F


def unpack_codes(w, bits, k):
    """MLX's packed codes: w [..., N, K*bits/32] uint32, an LSB-first bit stream per row -> int64 [..., N, K]."""
    words = w.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    words = torch.cat([words, torch.zeros_like(words[..., :1])], dim=-1)  # a word past the end for straddlers
    offset = torch.arange(k, device=w.device) * bits
    lo = words[..., offset // 32] >> (offset % 32)
    hi = words[..., offset // 32 + 1] << (32 - offset % 32)
    return (lo | hi) & ((1 << bits) - 1)


def dequantize(w, scales, biases, group_size, bits):
    """scales * q + biases in float32, [..., N, K]."""
    k = scales.shape[-1] * group_size
    q = unpack_codes(w, bits, k).to(torch.float32)
    s = scales.float().repeat_interleave(group_size, dim=-1)
    b = biases.float().repeat_interleave(group_size, dim=-1)
    return s * q + b


def projection(tensors, name, in_features):
    """The float32 weight [..., N, K] of projection `name` (quantized when it has .scales)."""
    w = tensors[name + ".weight"]
    if name + ".scales" not in tensors:
        return w.float()
    scales = tensors[name + ".scales"]
    group_size = in_features // scales.shape[-1]
    bits = w.shape[-1] * 32 // in_features
    return dequantize(w, scales, tensors[name + ".biases"], group_size, bits)


def router_logits(h, tensors, eps):
    """float32 logits [T, E]: rms_norm(h) * scale * H^-0.5 @ proj^T (Gemma 4's router, no norm weight)."""
    hf = h.float()
    r = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    r = r * tensors["router.scale"].float() * (h.shape[-1] ** -0.5)
    return r @ projection(tensors, "router.proj", h.shape[-1]).T


def router_weights(logits, indices, tensors):
    """softmax over the chosen k logits, times per_expert_scale[idx] (float32 [T, k])."""
    chosen = torch.gather(logits, 1, indices.long())
    return torch.softmax(chosen, dim=-1) * tensors["router.per_expert_scale"].float()[indices.long()]


def experts(x, indices, weights, tensors, dtype=torch.bfloat16, activation="geglu"):
    """sum_j weights[t, j] * down_e(act(gate_e x_t) * up_e x_t) with e = indices[t, j]: the GEMMs in `dtype`
    (fp32 accumulation inside torch), the GLU product in fp32, the combine in fp32. Returns float32 [T, H]."""
    H = x.shape[-1]
    prefix = "experts.switch_glu."
    if prefix + "gate_up_proj.weight" in tensors:
        gate_up = projection(tensors, prefix + "gate_up_proj", H)
        inter = gate_up.shape[-2] // 2
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
    else:
        gate = projection(tensors, prefix + "gate_proj", H)
        up = projection(tensors, prefix + "up_proj", H)
        inter = gate.shape[-2]
    down = projection(tensors, prefix + "down_proj", inter)
    out = torch.zeros(x.shape[0], H, dtype=torch.float32, device=x.device)
    flat = indices.reshape(-1).long()
    token = torch.arange(x.shape[0], device=x.device).repeat_interleave(indices.shape[1])
    w = weights.reshape(-1).float()
    act = (lambda g: F.gelu(g, approximate="tanh")) if activation == "geglu" else F.silu
    for e in torch.unique(flat).tolist():
        rows = (flat == e).nonzero().squeeze(1)
        xe = x[token[rows]].to(dtype)
        g = (xe @ gate[e].to(dtype).T).float()
        u = (xe @ up[e].to(dtype).T).float()
        y = ((act(g) * u).to(dtype) @ down[e].to(dtype).T).float()
        out.index_add_(0, token[rows], y * w[rows, None])
    return out


def rel_error(got, want):
    """||got - want|| / ||want|| in float64."""
    got, want = got.double(), want.double()
    return (torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)).item()


def random_mlx_moe(hidden, inter, experts_, device, seed=0, bits=4, group_size=64):
    """Random MLX-quantized MoE tensors (mlx-lm names) made with expertqmm.torch.quantize on `device`:
    weights N(0, 0.02) (dense scale of Gemma 4's), router scale ~1, per_expert_scale ~1."""
    from expertqmm import torch as eqt

    g = torch.Generator(device="cpu").manual_seed(seed)
    t = {}

    def quantized(name, shape):
        w = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16).to(device)
        t[name + ".weight"], t[name + ".scales"], t[name + ".biases"] = eqt.quantize(w, bits, group_size)

    quantized("router.proj", (experts_, hidden))
    t["router.scale"] = (1 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16).to(device)
    t["router.per_expert_scale"] = (1 + 0.1 * torch.randn(experts_, generator=g)).to(torch.bfloat16).to(device)
    quantized("experts.switch_glu.gate_proj", (experts_, inter, hidden))
    quantized("experts.switch_glu.up_proj", (experts_, inter, hidden))
    quantized("experts.switch_glu.down_proj", (experts_, hidden, inter))
    return t

