"""expertqmm.torch on the GPU (SKIP without one): the Gemma 4 26B-A4B MoE block against the plain-torch
bf16 reference, CUDA graph capture and replay, torch's current stream, torch.compile, CPU agreement."""
import pytest

from conftest import import_torch, require_cuda

torch = import_torch()

import expertqmm  # noqa: E402
import expertqmm.torch as eqt  # noqa: E402
import torch_reference as ref  # noqa: E402

BF16_BOUND = 1e-2
H, I, E, K = 2816, 704, 128, 8  # Gemma 4 26B-A4B (shared/spec/gemma4-moe.md)


@pytest.fixture(scope="module")
def gemma4_block():
    """A 26B-A4B-shaped MoE block with random weights quantized on the GPU, and its tensors."""
    require_cuda(torch)
    tensors = ref.random_mlx_moe(H, I, E, "cuda", seed=3)
    return eqt.MoeBlock(tensors, top_k=K), tensors


@pytest.mark.parametrize("T", [1, 8, 64, 512])
def test_cuda_moe_block_matches_the_torch_bf16_reference(gemma4_block, T):
    block, tensors = gemma4_block
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    out = block(x)
    assert out.dtype == torch.bfloat16 and out.device.type == "cuda"
    idx, w = expertqmm.route(x, expertqmm.MoeWeights.from_mlx(tensors, top_k=K))
    logits = ref.router_logits(x, tensors, eps=1e-6)
    assert ref.rel_error(w, ref.router_weights(logits, idx, tensors)) <= BF16_BOUND
    chosen = torch.gather(logits, 1, idx.long())
    rest = logits.scatter(1, idx.long(), float("-inf"))
    assert (chosen.min(1).values >= rest.max(1).values - 2e-2 * logits.abs().max()).all()  # top-k up to bf16 ties
    err = ref.rel_error(out, ref.experts(x, idx, w, tensors))
    print(f"T={T}: rel error vs torch bf16 reference {err:.2e}")
    assert err <= BF16_BOUND


def test_cuda_tile_experts_gives_the_same_bits(gemma4_block):
    _, tensors = gemma4_block
    weights = expertqmm.MoeWeights.from_mlx(tensors, top_k=K)
    x = torch.randn(512, H, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(5))
    before = expertqmm.moe_layer(x, weights)
    assert weights.tile_experts() == 3  # gate, up, down
    after = expertqmm.moe_layer(x, weights)  # the wgmma kernels on the tile layout (bench/NOTES.md step 51)
    assert torch.equal(before, after)


def test_cuda_graph_capture_and_replay(gemma4_block):
    block, _ = gemma4_block
    T = 64
    static_x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: the workspace grows to this T
        block(static_x)
    torch.cuda.current_stream().wait_stream(side)
    held = expertqmm.torch._REGISTRY[block.handle()].workspace.bytes_held
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = block(static_x)
    assert expertqmm.torch._REGISTRY[block.handle()].workspace.bytes_held == held  # nothing allocated in capture
    for seed in (1, 2):
        fresh = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(seed))
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert ref.rel_error(static_out, block(fresh)) <= 1e-3  # replay == eager on the new input


def test_cuda_runs_on_the_current_stream(gemma4_block):
    block, _ = gemma4_block
    x = torch.randn(8, H, device="cuda", dtype=torch.bfloat16)
    want = block(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # the stream is busy for a while: work on another stream would overtake
        y = x * 1                      # produced on `stream`, behind the sleep
        out = block(y)
    stream.synchronize()
    torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-3)


def test_cuda_torch_compile_matches_eager(gemma4_block):
    block, _ = gemma4_block
    x = torch.randn(16, H, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True)
    assert ref.rel_error(compiled(x), block(x)) <= 1e-3


def test_cuda_ops_match_the_cpu(tiny_checkpoint):
    require_cuda(torch)
    w = torch.randn(4, 256, 512, dtype=torch.bfloat16)
    q_cpu = expertqmm.quantize(w, 4, 64, "gpu")
    q_gpu = expertqmm.quantize(w.cuda(), 4, 64, "gpu")
    for a, b in zip(q_cpu, q_gpu):
        assert torch.equal(a, b.cpu())
    x = torch.randn(6, 1, 512, dtype=torch.bfloat16)
    idx = torch.tensor([3, 0, 0, 2, 1, 3])
    y_cpu = expertqmm.gather_qmm(x, *q_cpu, rhs_indices=idx)
    y_gpu = expertqmm.gather_qmm(x.cuda(), *q_gpu, rhs_indices=idx.cuda())
    assert ref.rel_error(y_gpu.cpu(), y_cpu) <= BF16_BOUND
    ck = expertqmm.Gemma4Checkpoint(tiny_checkpoint)
    h = torch.randn(10, 128, dtype=torch.bfloat16)
    ffn_gpu = eqt.Gemma4FeedForward.from_mlx_checkpoint(tiny_checkpoint, 1, device="cuda")
    assert ref.rel_error(ffn_gpu(h.cuda()).cpu(), expertqmm.gemma4_ffn(h, ck.layer(1))) <= BF16_BOUND
    expertqmm.cuda_check()


def test_cuda_gemma4_feed_forward_graph_capture(tiny_checkpoint):
    require_cuda(torch)
    ffn = eqt.Gemma4FeedForward.from_mlx_checkpoint(tiny_checkpoint, 0, device="cuda")
    static_h = torch.randn(24, 128, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ffn(static_h)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = ffn(static_h)
    fresh = torch.randn(24, 128, device="cuda", dtype=torch.bfloat16)
    static_h.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert ref.rel_error(static_out, ffn(fresh)) <= 1e-3
    expertqmm.cuda_check()
