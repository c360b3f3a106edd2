#!/usr/bin/env python3
"""MLX goldens for quantize / dequantize: usage `make_quant_goldens.py [OUTDIR]`.

Runs mx.quantize / mx.dequantize on MLX's CPU stream (the `Rounding::cpu` flavour) and writes
quant_{bf16,f16,f32}.safetensors. Each case <name> stores
  <name>.w       input (absent for dequantize-only cases)
  <name>.wq      uint32 codes      <name>.scales, <name>.biases
  <name>.w_hat   mx.dequantize(wq, scales, biases)
and the metadata entry "case.<name>" = "bits=B group_size=G kind=K".

The fp modes (mxfp4, mxfp8, nvfp4) go to quant_modes_{bf16,f16,f32}.safetensors, same layout
without biases (scales are uint8 codes), w_hat = mx.dequantize(..., dtype=<file dtype>), plus
<name>.global_scale (float32 scalar) on the nvfp4 cases that use one (their w_hat is float32, as
MLX returns it); metadata "case.<name>" = "mode=M bits=B group_size=G kind=K".
Deterministic: fixed seeds, no dependence on the machine.
"""
import os
import sys

import mlx.core as mx
import numpy as np

BITS = [2, 3, 4, 5, 6, 8]
GROUPS = [32, 64, 128]
DTYPES = {"bf16": mx.bfloat16, "f16": mx.float16, "f32": mx.float32}
CPU = mx.cpu


class Golden:
    def __init__(self, dtype_name):
        self.dtype_name = dtype_name
        self.dtype = DTYPES[dtype_name]
        self.tensors = {}
        self.meta = {"generator": "tests/golden/make_quant_goldens.py", "mlx_version": mx.__version__}

    def quant_case(self, name, w, bits, gs, kind):
        w = mx.array(w).astype(self.dtype) if not isinstance(w, mx.array) else w
        wq, s, b = mx.quantize(w, group_size=gs, bits=bits, stream=CPU)
        w_hat = mx.dequantize(wq, s, b, group_size=gs, bits=bits, stream=CPU)
        self._put(name, bits, gs, kind, w=w, wq=wq, scales=s, biases=b, w_hat=w_hat)

    def dequant_case(self, name, wq, scales, biases, bits, gs):
        w_hat = mx.dequantize(wq, scales, biases, group_size=gs, bits=bits, stream=CPU)
        self._put(name, bits, gs, "dequantize", wq=wq, scales=scales, biases=biases, w_hat=w_hat)

    def _put(self, name, bits, gs, kind, **arrays):
        assert f"case.{name}" not in self.meta, name
        for k, v in arrays.items():
            self.tensors[f"{name}.{k}"] = v
        self.meta[f"case.{name}"] = f"bits={bits} group_size={gs} kind={kind}"

    def save(self, outdir):
        mx.eval(list(self.tensors.values()))
        path = os.path.join(outdir, f"quant_{self.dtype_name}.safetensors")
        mx.save_safetensors(path, self.tensors, metadata=self.meta)
        return path


def representable(values, dtype):
    """Values that survive a round trip through dtype unchanged."""
    v = np.asarray(values, dtype=np.float32)
    back = np.array(mx.array(v).astype(dtype).astype(mx.float32))
    return v[back == v]


def spread(values, count):
    """`count` entries of values, evenly spaced (all when there are fewer)."""
    if len(values) <= count:
        return list(values)
    idx = np.linspace(0, len(values) - 1, count).round().astype(int)
    return [values[i] for i in idx]


def fill(values, gs, rng):
    """A group of exactly gs values: the given ones (cycled), shuffled."""
    values = np.asarray(values, dtype=np.float32)
    out = np.resize(values, gs)
    rng.shuffle(out)
    return out


def edge_groups(bits, gs, dtype, rng):
    """One row per edge case, each row a single group of gs values (float32, exact in dtype)."""
    n = (1 << bits) - 1
    rows = {}
    rows["all_negative"] = rng.uniform(-2.0, -0.5, gs)
    rows["all_positive"] = rng.uniform(0.25, 3.0, gs)
    rows["constant_positive"] = np.full(gs, 0.3)
    rows["constant_negative"] = np.full(gs, -0.7)
    rows["zeros"] = np.zeros(gs)
    rows["negative_zeros"] = np.full(gs, -0.0)
    rows["mixed_magnitudes"] = rng.standard_normal(gs) * 10.0 ** rng.uniform(-4, 2, gs)
    outlier = rng.standard_normal(gs) * 0.01
    outlier[rng.integers(gs)] = 50.0
    rows["outlier"] = outlier
    sym = rng.uniform(-0.5, 0.5, gs)
    sym[0], sym[1] = -0.75, 0.75  # |min| == |max|: the edge is w_max, scale negative
    rows["symmetric_extremes"] = sym
    rows["tiny"] = rng.standard_normal(gs) * 1e-8  # below eps: q0 == 0, bias 0, scale +-1e-7
    # Code ties: w_min = 0, w_max = n*s with s a power of two, so scale = -s and bias = n*s exactly;
    # w = (n - c - 0.5) * s then lands on the code c + 0.5 exactly (rint: even; GPU round: up).
    s = 2.0 ** -5
    ties = representable([(n - c - 0.5) * s for c in range(n)], dtype)
    rows["code_ties"] = fill([0.0, n * s] + spread(list(ties), gs - 2), gs, rng)
    # q0 tie: range n*s exact, edge = w_min = -(m + 0.5) s with m = 2^(bits-1) even, so
    # edge / scale = -(m + 0.5): rint gives -m, round gives -(m + 1).
    m = 1 << (bits - 1)
    w_min, w_max = -(m + 0.5) * s, (n - m - 0.5) * s
    if len(representable([w_min, w_max], dtype)) == 2:
        inner = rng.uniform(w_min, w_max, gs - 2)
        rows["q0_tie"] = fill([w_min, w_max] + list(inner), gs, rng)
    names = sorted(rows)
    w = np.stack([np.asarray(rows[k], dtype=np.float32) for k in names])
    return names, w


def random_codes(rng, rows, k, bits):
    words = k * bits // 32
    return mx.array(rng.integers(0, 2**32, size=(rows, words), dtype=np.uint64).astype(np.uint32))


def random_affine(rng, shape, dtype):
    # Magnitudes over six decades so that q*s and bias often differ by many binades.
    v = rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, 2, shape)
    return mx.array(v.astype(np.float32)).astype(dtype)


def build(dtype_name, seed):
    g = Golden(dtype_name)
    rng = np.random.default_rng(seed)
    full = dtype_name == "bf16"
    for bits in BITS:
        for gs in GROUPS:
            if full or gs == 64:
                w = rng.standard_normal((4, 256)).astype(np.float32) * rng.uniform(0.01, 2.0)
                g.quant_case(f"random_b{bits}_g{gs}", w, bits, gs, "random")
            if full or dtype_name == "f16" or gs == 32:
                names, w = edge_groups(bits, gs, g.dtype, rng)
                g.quant_case(f"edge_b{bits}_g{gs}", w, bits, gs, "edge:" + ",".join(names))
            if full or gs == 64:
                k = 2 * gs
                wq = random_codes(rng, 4, k, bits)
                s = random_affine(rng, (4, k // gs), g.dtype)
                b = random_affine(rng, (4, k // gs), g.dtype)
                g.dequant_case(f"deq_b{bits}_g{gs}", wq, s, b, bits, gs)
    # Leading batch dims are flattened into rows.
    w = rng.standard_normal((2, 3, 128)).astype(np.float32)
    g.quant_case("batch3d_b4_g64", w, 4, 64, "random")
    if dtype_name == "f32":
        # Spec 1.3 worked example: min -0.3, max 0.2 -> scale 0.3/9, bias -0.3, 0.0 at code 9.
        w = np.zeros((1, 32), dtype=np.float32)
        w[0, 0], w[0, 1] = -0.3, 0.2
        g.quant_case("worked_example_b4_g32", w, 4, 32, "worked_example")
    return g


# mode -> (bits, group size): each fp mode allows exactly one of each (mx.quantize's table).
FP_MODES = {"mxfp4": (4, 32), "mxfp8": (8, 32), "nvfp4": (4, 16)}
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


class FpGolden:
    def __init__(self, dtype_name):
        self.dtype_name = dtype_name
        self.dtype = DTYPES[dtype_name]
        self.tensors = {}
        self.meta = {"generator": "tests/golden/make_quant_goldens.py", "mlx_version": mx.__version__}

    def quant_case(self, name, w, mode, kind, global_scale=None):
        bits, gs = FP_MODES[mode]
        w = mx.array(np.asarray(w, dtype=np.float32)).astype(self.dtype)
        g = None if global_scale is None else mx.array(np.float32(global_scale))
        wq, s = mx.quantize(w, mode=mode, global_scale=g, stream=CPU)
        w_hat = mx.dequantize(wq, s, mode=mode, global_scale=g, dtype=self.dtype, stream=CPU)
        arrays = dict(w=w, wq=wq, scales=s, w_hat=w_hat)
        if g is not None:
            arrays["global_scale"] = g
        self._put(name, mode, bits, gs, kind, arrays)

    def dequant_case(self, name, wq, scales, mode):
        bits, gs = FP_MODES[mode]
        w_hat = mx.dequantize(wq, scales, mode=mode, dtype=self.dtype, stream=CPU)
        self._put(name, mode, bits, gs, "dequantize", dict(wq=wq, scales=scales, w_hat=w_hat))

    def _put(self, name, mode, bits, gs, kind, arrays):
        assert f"case.{name}" not in self.meta, name
        for k, v in arrays.items():
            self.tensors[f"{name}.{k}"] = v
        self.meta[f"case.{name}"] = f"mode={mode} bits={bits} group_size={gs} kind={kind}"

    def save(self, outdir):
        mx.eval(list(self.tensors.values()))
        path = os.path.join(outdir, f"quant_modes_{self.dtype_name}.safetensors")
        mx.save_safetensors(path, self.tensors, metadata=self.meta)
        return path


def fp_edge_groups(mode, gs, dtype, rng):
    """One row per edge case of the fp quantizers, each row one group of gs values."""
    rows = {}
    rows["zeros"] = np.zeros(gs)
    rows["negative_zeros"] = np.full(gs, -0.0)
    rows["constant_negative"] = np.full(gs, -0.7)
    rows["all_positive"] = rng.uniform(0.25, 3.0, gs)
    rows["mixed_magnitudes"] = rng.standard_normal(gs) * 10.0 ** rng.uniform(-4, 2, gs)
    outlier = rng.standard_normal(gs) * 0.01
    outlier[rng.integers(gs)] = 50.0
    rows["outlier"] = outlier
    rows["tiny"] = rng.standard_normal(gs) * 1e-6
    rows["large"] = np.clip(rng.standard_normal(gs) * 3e3, -6e4, 6e4)  # finite in float16
    # amax = 6 * 2^k exactly: the scale is a power of two and every E2M1 midpoint (0.25, 0.75,
    # 1.25, 1.75, 2.5, 3.5, 5) times it is a tie between two codes (MLX's argmin: the lower code).
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    ties = np.concatenate([[6.0], mids, -mids, mids * 0.999, -mids * 1.001])
    rows["e2m1_ties"] = fill(representable(ties * 0.25, dtype), gs, rng)
    # amax / maxval just either side of 2^(k + 1/2): log2 rounds up or down.
    for tag, f in (("log2_below", 0.99), ("log2_above", 1.01)):
        edge = (6.0 if FP_MODES[mode][0] == 4 else 448.0) * 2.0 ** 0.5 * f
        rows[tag] = fill([edge] + list(rng.uniform(-edge, edge, gs - 1)), gs, rng)
    # The E4M3 value grid with ties between its codes (mxfp8) and values that saturate at 448.
    if mode == "mxfp8":
        grid = rng.choice([1.0625, 1.1875, 2.125, 17.0, 0.0048828125, 400.0, 460.0, -470.0], gs)
        rows["e4m3_ties_and_saturation"] = grid
    if len(rows) % 2:  # MLX packs 4-bit codes 32 at a time: nvfp4 (16 per row) needs an even count
        rows["constant_positive"] = np.full(gs, 0.3)
    names = sorted(rows)
    w = np.stack([np.resize(np.asarray(rows[k], dtype=np.float32), gs) for k in names])
    return names, w


def random_scale_codes(rng, mode, shape, dtype_name):
    if mode == "nvfp4":  # positive E4M3 codes, 0x7F (480) left out
        return rng.integers(0, 0x7F, size=shape).astype(np.uint8)
    # E8M0 2^(s-127); float16 under- and overflows outside about [103, 142]: both kept in range,
    # plus the ends that float16 turns into 0 and subnormals.
    lo, hi = (100, 143) if dtype_name == "f16" else (90, 170)
    return rng.integers(lo, hi, size=shape).astype(np.uint8)


def build_fp(dtype_name, seed):
    g = FpGolden(dtype_name)
    rng = np.random.default_rng(seed)
    for mode, (bits, gs) in FP_MODES.items():
        for scale in (0.02, 1.0, 40.0):
            w = rng.standard_normal((4, 256)).astype(np.float32) * scale
            g.quant_case(f"random_{mode}_x{scale:g}", w, mode, "random")
        names, w = fp_edge_groups(mode, gs, g.dtype, rng)
        g.quant_case(f"edge_{mode}", w, mode, "edge:" + ",".join(names))
        k = 4 * gs
        codes = rng.integers(0, 2**32, size=(4, k * bits // 32), dtype=np.uint64).astype(np.uint32)
        if bits == 8:  # E4M3 0x7F / 0xFF are NaN; MLX's NaN payloads are not part of the format
            b = codes.view(np.uint8)
            b[(b & 0x7F) == 0x7F] &= 0xFE
        wq = mx.array(codes)
        s = mx.array(random_scale_codes(rng, mode, (4, k // gs), dtype_name))
        g.dequant_case(f"deq_{mode}", wq, s, mode)
        w = rng.standard_normal((2, 3, 64)).astype(np.float32)
        g.quant_case(f"batch3d_{mode}", w, mode, "random")
    # nvfp4 with a global scale (MLX's float32 scalar): typical (amax / (448 * 6)) and odd values.
    w = rng.standard_normal((4, 128)).astype(np.float32) * 3.0
    for i, gscale in enumerate((float(np.abs(w).max()) / 2688.0, 1.0, 0.37)):
        g.quant_case(f"global_nvfp4_{i}", w, "nvfp4", "global", global_scale=gscale)
    return g


def main():
    outdir = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    os.makedirs(outdir, exist_ok=True)
    for i, dtype_name in enumerate(DTYPES):
        path = build(dtype_name, seed=20260 + i).save(outdir)
        print(f"wrote {path} ({os.path.getsize(path)} bytes)")
        path = build_fp(dtype_name, seed=20270 + i).save(outdir)
        print(f"wrote {path} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
