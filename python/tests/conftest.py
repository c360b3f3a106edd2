"""Shared fixtures: a tiny synthetic checkpoint; torch and CUDA availability (their tests SKIP loudly)."""
import os

# MLX's CUDA backend runs float32 matmuls (its dense gather_mm among them) in TF32 unless
# MLX_ENABLE_TF32=0 (MLX's environment variables page); the test_mlx float32 bounds (docs/numerics.md)
# compare against full float32. Set before any test module imports mlx.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import pytest  # noqa: E402

import expertqmm  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A synthetic MLX-format checkpoint at the tiny geometry (H=128, 8 experts, top-2), 2 layers."""
    return expertqmm.write_synthetic_checkpoint(os.path.join(tmp_path_factory.mktemp("ckpt"), "tiny"), "tiny",
                                                layers=2, seed=7)


def import_torch():
    """torch, or a loud SKIP of the calling module when it is not installed."""
    return pytest.importorskip("torch", reason="torch is not installed: the expertqmm.torch tests are SKIPPED")


def require_cuda(torch):
    """SKIP unless torch sees a GPU and expertqmm was built with CUDA (and FAIL if only the latter is missing
    while a GPU is present, so a CPU-only wheel on the GPU machine cannot pass silently)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the GPU tests are SKIPPED")
    assert expertqmm.cuda_built(), "a GPU is present but this expertqmm was built without CUDA (nvcc missing?)"
