#!/usr/bin/env python3
"""MLX goldens for quantize / dequantize: usage `make_quant_goldens.py [OUTDIR]`.

Runs mx.quantize / mx.dequantize on MLX's CPU stream (the `Rounding::cpu` flavour) and writes
quant_{bf16,f16,f32}.safetensors. Each case <name> stores
  <name>.w       input (absent for dequantize-only cases)
  <name>.wq      uint32 codes      <name>.scales, <name>.biases
  <name>.w_hat   mx.dequantize(wq, scales, biases)
and the metadata entry "case.<name>" = "bits=B group_size=G kind=K".
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


def main():
    outdir = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    os.makedirs(outdir, exist_ok=True)
    for i, dtype_name in enumerate(DTYPES):
        path = build(dtype_name, seed=20260 + i).save(outdir)
        print(f"wrote {path} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
