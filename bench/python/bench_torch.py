#!/usr/bin/env python3
"""expertqmm.torch against its torch peers in one process, with `expertqmm bench`'s protocol.

The Gemma 4 26B-A4B expert layer (synthetic MLX weights as the C++ bench makes them: random 4-bit
codes, bf16 scales +-(0.01 + 0.002 N), centring biases; a dense bf16 router with std 1/sqrt(H) on
N(0, 1) tokens: uniform routing), per token count, per peer:
  - expertqmm.torch: the MoeBlock module (torch.ops.expertqmm.moe_layer: router, experts, combine);
  - torch bf16: bench/peers/torch_grouped.py's layer (torch._grouped_mm on dequantized bf16 weights)
    on the routing expertqmm computed (its router is not timed, as in gpu-check's peer).
Protocol (bench/README.md): 4 weight copies, one CUDA graph per copy replayed round robin, an L2
flush (2x L2, >= 64 MiB) before every replay outside its event pair, median / p10 / p90 over
--replays after 2 warm-up rounds; the ceilings (copy bandwidth, bf16 GEMM rate) measured first, the
floor = max(FLOPs / bf16 rate, bytes / copy bandwidth). 2 tokens checked against float64.
Writes `expertqmm bench --json`'s shape (each row has a "peer") and a PNG of us and time/floor by
tokens. Each token count runs in a child process (as torch_grouped.py does).

  python3 bench/python/bench_torch.py --json out/bench-python.json --png out/bench-python.png
  python3 bench/python/bench_torch.py --from-json FILE --png FILE     # plot/table only (no GPU)
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PRESET = {"name": "gemma4-26b-a4b", "experts": 128, "top_k": 8, "hidden": 2816, "intermediate": 704,
          "bits": 4, "group_size": 64}
WEIGHT_COPIES = 4
PEERS = ("expertqmm.torch", "torch bf16 _grouped_mm")


def expert_bytes(p):
    """Bytes of one expert: gate, up and down codes plus bf16 scales and biases (3,345,408 for 26B-A4B)."""
    per_matrix = p["intermediate"] * p["hidden"]
    codes = per_matrix * p["bits"] // 8
    groups = per_matrix // p["group_size"] * 2 * 2  # scale and bias, bf16
    return 3 * (codes + groups)


def derived(p, tokens, experts_hit, us_median, ceilings):
    """The C++ bench's derived numbers of a row (bench/README.md, step 5)."""
    flops = 2.0 * tokens * p["top_k"] * 3 * p["intermediate"] * p["hidden"]
    nbytes = float(experts_hit * expert_bytes(p) + 2 * tokens * p["hidden"] * 2)
    floor_us = max(flops / (ceilings["bf16_tflops"] * 1e12), nbytes / (ceilings["copy_gbps"] * 1e9)) * 1e6
    return {"flops": flops, "bytes": nbytes, "floor_us": floor_us, "time_over_floor": us_median / floor_us,
            "tflops": flops / (us_median * 1e-6) / 1e12, "gbps": nbytes / (us_median * 1e-6) / 1e9}


def table(result):
    """A text table: tokens, then us and time/floor per peer."""
    rows = {}
    for r in result["rows"]:
        rows.setdefault(r["tokens"], {})[r["peer"]] = r
    peers = [p for p in PEERS if any(p in v for v in rows.values())]
    lines = [f"{'tokens':>6} " + " ".join(f"{p + ' us':>26} {'/floor':>7}" for p in peers) + f" {'floor us':>9}"]
    for t in sorted(rows):
        cells = []
        for p in peers:
            r = rows[t].get(p)
            cells.append(f"{r['us_median']:>26.1f} {r['time_over_floor']:>7.2f}" if r else f"{'-':>26} {'-':>7}")
        floor = next(iter(rows[t].values()))["floor_us"]
        lines.append(f"{t:>6} " + " ".join(cells) + f" {floor:>9.1f}")
    return "\n".join(lines)


def plot(result, png):
    """us and time/floor by tokens, one line per peer (log-log), to `png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_us, ax_floor) = plt.subplots(1, 2, figsize=(11, 4.2))
    for peer in PEERS:
        rows = sorted((r for r in result["rows"] if r["peer"] == peer), key=lambda r: r["tokens"])
        if rows:
            t = [r["tokens"] for r in rows]
            ax_us.plot(t, [r["us_median"] for r in rows], marker="o", label=peer)
            ax_floor.plot(t, [r["time_over_floor"] for r in rows], marker="o", label=peer)
    floor = sorted({(r["tokens"], r["floor_us"]) for r in result["rows"]})
    ax_us.plot([t for t, _ in floor], [f for _, f in floor], linestyle="--", color="gray", label="floor")
    ax_us.set(xscale="log", yscale="log", xlabel="tokens", ylabel="us per layer (median)")
    ax_floor.set(xscale="log", xlabel="tokens", ylabel="time / floor")
    ax_floor.axhline(1.0, color="gray", linestyle="--")
    for ax in (ax_us, ax_floor):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"{result['preset']} expert layer, {result['routing']} routing, {result['gpu']} "
                 f"({result['commit'][:7]})")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- GPU part
def measure_ceilings(torch):
    """Copy bandwidth (1 GiB device to device, read + write) and bf16 GEMM rate (8192^3), medians of 10."""
    def median_ms(fn, warmup, reps):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[reps // 2]

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_gbps = 2 * (1 << 30) / (median_ms(lambda: dst.copy_(src), 1, 10) * 1e-3) / 1e9
    del src, dst
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    bf16_tflops = 2 * n ** 3 / (median_ms(lambda: a @ b, 3, 10) * 1e-3) / 1e12
    return {"copy_gbps": copy_gbps, "bf16_tflops": bf16_tflops}


def synthetic_tensors(torch, p, seed, device):
    """The C++ bench's synthetic layer, in mlx-lm names: random codes, scales +-(0.01 + 0.002 N), biases
    -scale * (2^(bits-1) - 1/2); a dense router [E, H] ~ N(0, 1/H), scale and per-expert scale ~ 1 + 0.05 N."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    E, H, I, bits, gs = p["experts"], p["hidden"], p["intermediate"], p["bits"], p["group_size"]
    t = {}
    for name, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        codes = torch.randint(-2 ** 31, 2 ** 31, (E, n, k * bits // 32), generator=g, dtype=torch.int64)
        sign = torch.where(torch.rand(E, n, k // gs, generator=g) < 0.5, -1.0, 1.0)
        scales = sign * (0.01 + 0.002 * torch.randn(E, n, k // gs, generator=g))
        prefix = f"experts.switch_glu.{name}."
        t[prefix + "weight"] = codes.to(torch.int32).view(torch.uint32).to(device)
        t[prefix + "scales"] = scales.to(torch.bfloat16).to(device)
        t[prefix + "biases"] = (-scales * (2 ** (bits - 1) - 0.5)).to(torch.bfloat16).to(device)
    t["router.proj.weight"] = (torch.randn(E, H, generator=g) / H ** 0.5).to(torch.bfloat16).to(device)
    t["router.scale"] = (1 + 0.05 * torch.randn(H, generator=g)).to(torch.bfloat16).to(device)
    t["router.per_expert_scale"] = (1 + 0.05 * torch.randn(E, generator=g)).to(torch.bfloat16).to(device)
    return t


def run_tokens(T, replays, ceilings):
    """The rows of one token count (run in a child process)."""
    import torch

    sys.path[:0] = [os.path.join(HERE, "..", "peers"), os.path.join(HERE, "..", "..", "python", "tests")]
    import torch_grouped
    import torch_reference as ref
    import expertqmm
    import expertqmm.torch as eqt

    p = PRESET
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 0)) or (64 << 20)
    flush = torch.empty(max(2 * l2, 64 << 20), dtype=torch.uint8, device="cuda")
    tensors = synthetic_tensors(torch, p, seed=1, device="cuda")
    x = torch.randn(T, p["hidden"], device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(T))
    blocks = [eqt.MoeBlock(tensors if c == 0 else {k: v.clone() for k, v in tensors.items()}, top_k=p["top_k"])
              for c in range(WEIGHT_COPIES)]
    idx, wts = expertqmm.route(x, expertqmm.MoeWeights.from_mlx(tensors, top_k=p["top_k"]))
    experts_hit = int(torch.unique(idx).numel())
    tokens = [0, T - 1] if T > 1 else [0]
    want = ref.experts(x[tokens], idx[tokens], wts[tokens], tensors, dtype=torch.float64)

    def capture(fns):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture (the workspaces grow here)
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graphs, outs = [], []
        for fn in fns:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs.append(fn())
            graphs.append(g)
        return graphs, outs

    runs = {"expertqmm.torch": [lambda b=b: b(x) for b in blocks]}
    if hasattr(torch, "_grouped_mm"):
        names = ("experts.switch_glu.gate_proj", "experts.switch_glu.up_proj", "experts.switch_glu.down_proj")
        gate, up, down = (ref.projection(tensors, n, p["hidden"] if n != names[2] else p["intermediate"]).to(torch.bfloat16)
                          for n in names)
        gate_up = torch.cat([gate, up], dim=1)
        del gate, up
        copies = [(gate_up, down)] + [(gate_up.clone(), down.clone()) for _ in range(WEIGHT_COPIES - 1)]
        runs["torch bf16 _grouped_mm"] = [
            torch_grouped.layer_fn(x, idx, wts, gu.transpose(-2, -1), dn.transpose(-2, -1), p["experts"], p["top_k"],
                                 torch_grouped.ACTIVATIONS["geglu"])
            for gu, dn in copies]
    rows = []
    for peer, fns in runs.items():
        graphs, outs = capture(fns)
        med, p10, p90 = torch_grouped.time_graphs(graphs, replays, flush)
        err = ref.rel_error(outs[0][tokens], want)
        row = {"tokens": T, "peer": peer, "product": "fused", "assignments": T * p["top_k"], "experts_hit": experts_hit,
               "replays": replays, "us_median": med, "us_p10": p10, "us_p90": p90, "rel_error": err,
               "check": "PASS" if err <= 1e-2 else "FAIL"}
        row.update(derived(p, T, experts_hit, med, ceilings))
        rows.append(row)
        print(f"T={T:<5} {peer:>24}: {med:9.1f} us (p10 {p10:.1f}, p90 {p90:.1f}), {row['time_over_floor']:.2f}x floor, "
              f"rel err {err:.2e} {row['check']}", flush=True)
        del graphs, outs
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,8,16,32,64,512,1024,2048")
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--png", help="plot us and time/floor by tokens here")
    ap.add_argument("--from-json", help="no GPU work: table and plot of this results file")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ceilings", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        json.dump(run_tokens(args.child, args.replays, json.loads(args.ceilings)), open(args.json, "w"))
        return
    if args.from_json:
        result = json.load(open(args.from_json))
    else:
        import torch

        if not torch.cuda.is_available():
            sys.exit("bench_torch.py: needs a CUDA device (--from-json FILE plots an existing result)")
        ceilings = measure_ceilings(torch)
        print(f"ceilings: copy {ceilings['copy_gbps']:.0f} GB/s, bf16 {ceilings['bf16_tflops']:.0f} TFLOP/s", flush=True)
        rows = []
        for T in (int(t) for t in args.tokens.split(",")):
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                child = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(T), "--replays",
                                        str(args.replays), "--ceilings", json.dumps(ceilings), "--json", tmp.name])
                if child.returncode != 0:
                    sys.exit(f"bench_torch.py: T={T} failed (exit {child.returncode})")
                rows += json.load(open(tmp.name))
        commit = os.environ.get("EXPERTQMM_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
        result = {"commit": commit, "gpu": torch.cuda.get_device_name(0),
                  "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                  "ceilings": ceilings, "preset": PRESET["name"], "routing": "uniform", "torch": torch.__version__,
                  "protocol": {"weight_copies": WEIGHT_COPIES, "replays": args.replays, "statistic": "median",
                               "l2_flush_bytes": "2 x L2, at least 64 MiB"},
                  "rows": rows}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
                f.write("\n")
    print(table(result))
    if args.png:
        try:
            plot(result, args.png)
            print(f"plot: {args.png}")
        except ImportError:  # the GPU machine may lack it: the JSON is written, plot it elsewhere
            print(f"no matplotlib: no {args.png}; plot with --from-json {args.json or 'FILE'} --png ... elsewhere")
    if any(r.get("check") == "FAIL" for r in result["rows"]):
        sys.exit("bench_torch.py: a row failed its check against float64")


if __name__ == "__main__":
    main()
