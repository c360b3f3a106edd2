#!/usr/bin/env python3
"""torch bf16 peer of `expertqmm bench`: the same MoE expert layer on the SAME weights and routing.

Reads what `expertqmm bench --export-dir DIR` wrote (DIR/weights.safetensors: the 4-bit MLX expert
weights of weight copy 0; DIR/case_T<T>.safetensors: tokens x, routing indices and weights, and our
output), dequantizes the weights on the GPU (nibbles LSB first, w = s*q + b in fp32, then bf16) and
times the whole layer in bf16: argsort, row gather, torch._grouped_mm for gate/up, act(gate)*up
(the exported activation: gelu(tanh) for geglu, silu for swiglu),
torch._grouped_mm for down, weighted index_add back to the tokens. The protocol is the bench's:
one CUDA graph per weight copy (4 copies, replayed round robin), an L2 flush (2x the L2 size)
before every replay outside the timed region, one event pair per replay, median / p10 / p90 over
the replays after a warm-up. The output of the bench's checked tokens (2, none on a router
near-tie) is checked against float64.

Needs only torch (with torch._grouped_mm, sm90+) and safetensors.
"""
import argparse
import datetime
import glob
import json
import os
import re
import subprocess
import tempfile
import sys

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

WEIGHT_COPIES = 4
REPLAYS_PER_SLEEP = 8  # replays enqueued behind one spin kernel (keeps host launch time out of the timing)


def dequantize(w, scales, biases, bits, group_size, dtype):
    """MLX affine dequantize of w [E, N, K*bits/32] (uint32 words, LSB-first codes) -> [E, N, K].

    Computed in fp32 as float(s) * q + float(b), then cast to `dtype`, a few experts at a time to
    bound the temporaries."""
    if bits not in (2, 4, 8):
        raise ValueError(f"dequantize: only power-of-two bit widths are implemented here, got {bits}")
    per_word = 32 // bits
    mask = (1 << bits) - 1
    shifts = torch.arange(per_word, device=w.device, dtype=torch.int32) * bits
    words = w if w.dtype == torch.int32 else w.view(torch.int32)  # shifts may be arithmetic: codes are masked
    E, N, W = words.shape
    out = torch.empty((E, N, W * per_word), dtype=dtype, device=w.device)
    step = 8
    for e0 in range(0, E, step):
        q = (words[e0:e0 + step].unsqueeze(-1) >> shifts) & mask  # [e, N, W, per_word]
        q = q.reshape(q.shape[0], N, W * per_word).float()
        s = scales[e0:e0 + step].float().repeat_interleave(group_size, dim=-1)
        b = biases[e0:e0 + step].float().repeat_interleave(group_size, dim=-1)
        out[e0:e0 + step] = (s * q + b).to(dtype)
    return out


# The GLU activations of the exported layer (expertqmm's Activation names).
ACTIVATIONS = {
    "geglu": lambda g: F.gelu(g, approximate="tanh"),
    "swiglu": F.silu,
}


class ExpertWeights:
    """The exported quantized experts, with gate and up as one [E, 2I, H] (gate rows first)."""

    def __init__(self, export_dir, device):
        path = os.path.join(export_dir, "weights.safetensors")
        with safe_open(path, framework="pt") as f:
            self.meta = f.metadata() or {}
        # Loaded on the host first: uint32 words are reinterpreted as int32 there (a free view), so
        # no uint32 kernel is ever needed on the device.
        t = {name: (v.view(torch.int32) if v.dtype == getattr(torch, "uint32", None) else v).to(device)
             for name, v in load_file(path).items()}
        self.bits = int(self.meta["bits"])
        self.group_size = int(self.meta["group_size"])
        self.top_k = int(self.meta["top_k"])
        self.activation = self.meta.get("activation", "geglu")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"{path}: unknown activation {self.activation} (known: {', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[self.activation]

        def q(name):
            return tuple(t[f"switch_glu.{name}.{part}"] for part in ("weight", "scales", "biases"))

        if "switch_glu.gate_up_proj.weight" in t:
            self.gate_up_q = [q("gate_up_proj")]
        else:
            self.gate_up_q = [q("gate_proj"), q("up_proj")]
        self.down_q = q("down_proj")
        self.experts = self.down_q[0].shape[0]
        self.hidden = self.down_q[0].shape[1]
        self.intermediate = self.down_q[0].shape[2] * 32 // self.bits

    def dequantized(self, dtype):
        """(gate_up [E, 2I, H], down [E, H, I]) in dtype."""
        parts = [dequantize(*wq, self.bits, self.group_size, dtype) for wq in self.gate_up_q]
        gate_up = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return gate_up.contiguous(), dequantize(*self.down_q, self.bits, self.group_size, dtype)

    def expert_f64(self, e):
        """Expert e dequantized in fp32 (MLX) and widened to float64: gate_up [2I, H], down [H, I]."""
        def one(wq):
            w, s, b = (x[e:e + 1] for x in wq)
            return dequantize(w, s, b, self.bits, self.group_size, torch.float32)[0].double()
        gate_up = torch.cat([one(wq) for wq in self.gate_up_q], dim=0)
        return gate_up, one(self.down_q)


def layer_fn(x, idx, wts, gate_up_t, down_t, experts, top_k, act):
    """The layer on static inputs; gate_up_t [E, H, 2I] and down_t [E, I, H] are transposed views."""
    T, H = x.shape
    I = down_t.shape[1]
    flat = idx.reshape(-1).long()
    ones = torch.ones_like(flat)

    def run():
        order = torch.argsort(flat, stable=True)
        token = order // top_k
        rows = x.index_select(0, token)
        # scatter_add instead of bincount: bincount reads its size on the host, which a graph forbids
        counts = torch.zeros(experts, dtype=torch.long, device=x.device).scatter_add_(0, flat, ones)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        gu = torch._grouped_mm(rows, gate_up_t, offs=offs)  # [T*k, 2I]
        h = act(gu[:, :I]) * gu[:, I:]
        y = torch._grouped_mm(h, down_t, offs=offs)  # [T*k, H]
        scaled = y.float() * wts.reshape(-1).index_select(0, order).float().unsqueeze(1)
        return torch.zeros((T, H), dtype=torch.float32, device=x.device).index_add_(0, token, scaled).to(x.dtype)

    return run


def percentile(sorted_v, q):
    return sorted_v[int(q * (len(sorted_v) - 1) + 0.5)]


def time_graphs(graphs, replays, flush):
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    stops = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for r in range(2 * len(graphs)):
        graphs[r % len(graphs)].replay()
    torch.cuda.synchronize()
    for first in range(0, replays, REPLAYS_PER_SLEEP):
        torch.cuda._sleep(2_000_000)  # ~1 ms of spinning: the batch below is enqueued before it ends
        for r in range(first, min(replays, first + REPLAYS_PER_SLEEP)):
            flush.fill_(r & 0xFF)
            starts[r].record()
            graphs[r % len(graphs)].replay()
            stops[r].record()
    torch.cuda.synchronize()
    us = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, stops))
    n = len(us)
    median = us[n // 2] if n % 2 else 0.5 * (us[n // 2 - 1] + us[n // 2])
    return median, percentile(us, 0.1), percentile(us, 0.9)


def rel_error(got, ref):
    got = got.double()
    if not torch.isfinite(got).all():
        return float("inf")
    den = torch.linalg.vector_norm(ref).item()
    num = torch.linalg.vector_norm(got - ref).item()
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def finite_or_none(v):
    """JSON has no Inf or NaN: a non-finite error is written as null (and fails the check)."""
    return v if v is not None and v == v and abs(v) != float("inf") else None


def reference_tokens(ew, x, idx, wts, tokens):
    """float64 out[t] = sum_j w[t,j] * down_e(act(gate_e x) * up_e x) for the given tokens."""
    I = ew.intermediate
    cache = {}
    out = torch.zeros((len(tokens), ew.hidden), dtype=torch.float64, device=x.device)
    for n, t in enumerate(tokens):
        xt = x[t].double()
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e not in cache:
                cache[e] = ew.expert_f64(e)
            gate_up, down = cache[e]
            g = gate_up[:I] @ xt
            u = gate_up[I:] @ xt
            hdn = ew.act(g) * u
            out[n] += float(wts[t, j].double()) * (down @ hdn)
    return out


def run_export_dir(export_dir, replays, l2_bytes, device, only_tokens=None):
    ew = ExpertWeights(export_dir, device)
    gate_up, down = ew.dequantized(torch.bfloat16)
    copies = [(gate_up, down)] + [(gate_up.clone(), down.clone()) for _ in range(WEIGHT_COPIES - 1)]
    del gate_up, down
    flush = torch.empty(max(2 * l2_bytes, 64 << 20), dtype=torch.uint8, device=device)

    cases = []
    for path in glob.glob(os.path.join(export_dir, "case_T*.safetensors")):
        m = re.search(r"case_T(\d+)\.safetensors$", path)
        if m:
            cases.append((int(m.group(1)), path))
    if not cases:
        raise FileNotFoundError(f"{export_dir}: no case_T*.safetensors (run `expertqmm bench --export-dir`)")
    rows = []
    for T, path in sorted(cases):
        if only_tokens is not None and T != only_tokens:
            continue
        c = load_file(path, device=device)
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
        x, idx, wts = c["x"].contiguous(), c["indices"].contiguous(), c["weights"].contiguous()
        assert x.shape[0] == T and idx.shape == (T, ew.top_k), f"{path}: shapes {x.shape} {idx.shape}"

        graphs, outs = [], []
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        for gu, dn in copies:
            fn = layer_fn(x, idx, wts, gu.transpose(-2, -1), dn.transpose(-2, -1), ew.experts, ew.top_k, ew.act)
            with torch.cuda.stream(side):  # warm-up off the capture, as torch's graph docs ask
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs.append(fn())
            graphs.append(g)
        med, p10, p90 = time_graphs(graphs, replays, flush)

        # The bench's checked tokens (none decided by a router near-tie, where the layer's own router
        # may pick another expert than the exported routing); older exports: the first and last.
        listed = meta.get("checked_tokens", "")
        tokens = [int(t) for t in listed.split(",") if t] or ([0, T - 1] if T > 1 else [0])
        ref = reference_tokens(ew, x, idx, wts, tokens)
        ours = c.get("out")
        err = rel_error(outs[0][tokens], ref)
        err_ours = rel_error(ours[tokens], ref) if ours is not None else None
        err_vs_ours = rel_error(outs[0][tokens], ours[tokens].double()) if ours is not None else None
        row = {
            "export_dir": export_dir,
            "preset": ew.meta.get("preset", ""),
            "routing": meta.get("routing", ew.meta.get("routing", "")),
            "tokens": T,
            "assignments": T * ew.top_k,
            "experts_hit": int(torch.unique(idx).numel()),
            "replays": replays,
            "us_median": med,
            "us_p10": p10,
            "us_p90": p90,
            "rel_error": finite_or_none(err),
            "rel_error_ours": finite_or_none(err_ours),
            "rel_error_torch_vs_ours": finite_or_none(err_vs_ours),
            "checked_tokens": tokens,
        }
        rows.append(row)
        fmt = lambda v: "-" if v is None else f"{v:.2e}"
        print(f"{row['routing']:>8} T={T:<5} {med:9.1f} us (p10 {p10:.1f}, p90 {p90:.1f})  "
              f"rel err vs f64: torch {fmt(err)}, ours {fmt(err_ours)}; torch vs ours {fmt(err_vs_ours)}",
              flush=True)
        del graphs, outs
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export-dir", action="append", required=True,
                    help="a directory written by `expertqmm bench --export-dir` (repeatable)")
    ap.add_argument("--json", required=True, help="output JSON file")
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--only-tokens", type=int, default=None,
                    help="run just this token count (the parent runs each case in a child process)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("torch_grouped.py: needs a CUDA device")
    if not hasattr(torch, "_grouped_mm"):
        sys.exit(f"torch_grouped.py: torch {torch.__version__} has no torch._grouped_mm")
    if args.replays < 1:
        sys.exit("torch_grouped.py: --replays must be >= 1")
    device = "cuda"
    props = torch.cuda.get_device_properties(0)
    l2_bytes = int(getattr(props, "L2_cache_size", 0)) or (64 << 20)

    rows = []
    if args.only_tokens is not None:
        for d in args.export_dir:
            rows += run_export_dir(d, args.replays, l2_bytes, device, args.only_tokens)
    else:
        # One child process per (export dir, token count): after a case's graphs are freed, capturing
        # the next case's graphs in the same process tripped _grouped_mm's device-side offset check
        # (torch 2.11, H200), while each case alone runs clean. A fresh process per case avoids it.
        for d in args.export_dir:
            tokens = sorted(int(m.group(1)) for m in (re.search(r"case_T(\d+)\.safetensors$", p)
                                                      for p in glob.glob(os.path.join(d, "case_T*.safetensors"))) if m)
            if not tokens:
                sys.exit(f"torch_grouped.py: {d}: no case_T*.safetensors (run `expertqmm bench --export-dir`)")
            for T in tokens:
                with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                    child = subprocess.run([sys.executable, os.path.abspath(__file__), "--export-dir", d,
                                            "--json", tmp.name, "--replays", str(args.replays),
                                            "--only-tokens", str(T)])
                    part = json.load(open(tmp.name)) if os.path.getsize(tmp.name) else {"rows": []}
                rows += part["rows"]
                if child.returncode != 0 and not part["rows"]:
                    sys.exit(f"torch_grouped.py: the child for {d} T={T} failed (exit {child.returncode})")

    commit = os.environ.get("EXPERTQMM_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], capture_output=True, text=True).stdout.strip()
        except OSError:
            commit = ""
    result = {
        "peer": "torch bf16 _grouped_mm (dequantized weights)",
        "commit": commit or "unknown",
        "gpu": props.name,
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "protocol": {"weight_copies": WEIGHT_COPIES, "l2_flush_bytes": max(2 * l2_bytes, 64 << 20),
                     "replays": args.replays, "statistic": "median"},
        "rows": rows,
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2, allow_nan=False, default=str)
        f.write("\n")
    bad = [r["tokens"] for r in rows if r["rel_error"] is None or not r["rel_error"] <= 1e-2]
    if bad:
        sys.exit(f"torch_grouped.py: torch output differs from float64 by more than 1e-2 at tokens {bad}")


if __name__ == "__main__":
    main()
