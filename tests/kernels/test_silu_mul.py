"""SwiGLU's `silu(gate) * up` from the fused gate/up output: the reference is HF's MLP
activation and product, and the Triton kernel (interpreted on the CPU, compiled on a GPU)
agrees with it."""

import pytest
import torch

from omniflow.kernels import silu_mul

SHAPES = [(1, 2 * 100), (3, 2 * 1024), (2, 2 * 4865)]  # widths around and across blocks


def cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(shape, generator=g) * 4).to(dtype)
        for shape in SHAPES
        for dtype in (torch.float32, torch.bfloat16)
    ]


def run_kernel(found: list[torch.Tensor]) -> list[torch.Tensor]:
    """Runs under TRITON_INTERPRET=1."""
    return [silu_mul.silu_mul_triton(x) for x in found]


def assert_agree(got: torch.Tensor, want: torch.Tensor, steps: int = 1) -> None:
    """Within `steps` steps of bfloat16; float32 to rounding."""
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 1e-6 if got.dtype == torch.float32 else steps * 2**-7
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_the_reference_is_hf_swiglu():
    for x in cases():
        half = x.shape[1] // 2
        assert torch.equal(silu_mul.reference(x), torch.nn.SiLU()(x[:, :half]) * x[:, half:])


def test_kernel_agrees_with_the_reference(interpret):
    """Triton's interpreter rounds float32 to bfloat16 towards zero (the GPU rounds to
    nearest, as torch does), so interpreted bf16 results may sit a few steps off."""
    found = cases()
    for x, got in zip(found, interpret(run_kernel, found), strict=True):
        assert_agree(got, silu_mul.reference(x), steps=4)


def test_shapes_are_checked():
    with pytest.raises(silu_mul.ActivationError):
        silu_mul.silu_mul(torch.zeros(2, 5))


@pytest.mark.gpu
def test_kernel_agrees_with_the_reference_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for x in cases():
        assert_agree(silu_mul.silu_mul(x.cuda()), silu_mul.reference(x.cuda()))
