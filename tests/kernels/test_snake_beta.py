"""SnakeBeta in one pass (`snake_beta`): its reference is transformers' SnakeBeta module op
by op, and its Triton kernel (interpreted on the CPU, compiled on a GPU) agrees with the
reference in float32 and bf16."""

import pytest
import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeSnakeBeta

from omniflow.kernels import snake_beta as kernel

# (B, C, T): one sample, rows shorter than, across and past a block, many channels of a
# few samples (the decoder's first activation at one frame).
SHAPES = [(1, 1, 1), (2, 3, 5), (1, 4, 300), (2, 2, 1500), (1, 1536, 4)]


def module(channels: int, generator: torch.Generator) -> torch.nn.Module:
    """transformers' module with random parameters (they load as zeros)."""
    snake = Qwen3OmniMoeSnakeBeta(channels)
    snake.alpha.data = torch.randn(channels, generator=generator) / 2
    snake.beta.data = torch.randn(channels, generator=generator) / 2
    return snake


def cases() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    found = []
    for batch, channels, length in SHAPES:
        snake = module(channels, g)
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(batch, channels, length, generator=g) * 2).to(dtype)
            alpha, beta = (p.detach().to(dtype) for p in (snake.alpha, snake.beta))
            found.append({"x": x, "alpha": alpha, "beta": beta})  # a module in x's dtype
    return found


def run_kernel(found: list[dict]) -> list[torch.Tensor]:
    """Runs under TRITON_INTERPRET=1."""
    return [kernel.snake_beta_triton(**case) for case in found]


def assert_agree(got: list[torch.Tensor], found: list[dict]) -> None:
    """float32: to its rounding (libdevice's `sinf`, Triton's `exp`, the reciprocal rounded
    once); bf16: a step at the output's magnitude (the kernel rounds once, the reference
    after each op)."""
    for out, case in zip(got, found, strict=True):
        want = kernel.reference(**case)
        assert out.dtype == want.dtype and out.shape == want.shape
        exact = kernel.reference(case["x"].double(), case["alpha"].double(), case["beta"].double())
        step = 1e-6 if want.dtype == torch.float32 else 2**-7
        scale = exact.abs().max().item()
        torch.testing.assert_close(out.double(), exact, rtol=0, atol=2 * step * scale)


def test_the_reference_is_transformers_module():
    g = torch.Generator().manual_seed(1)
    for batch, channels, length in SHAPES:
        snake = module(channels, g)
        x = torch.randn(batch, channels, length, generator=g) * 2
        with torch.no_grad():
            want = snake(x)
        assert torch.equal(kernel.reference(x, snake.alpha.detach(), snake.beta.detach()), want)


def test_kernel_agrees_with_the_reference(interpret):
    found = cases()
    assert_agree(interpret(run_kernel, found), found)


def test_shapes_are_checked():
    alpha = torch.zeros(4)
    with pytest.raises(kernel.SnakeBetaError, match=r"\[B, C, T\]"):
        kernel.snake_beta(torch.zeros(4, 10), alpha, alpha)
    with pytest.raises(kernel.SnakeBetaError, match="C=4"):
        kernel.snake_beta(torch.zeros(2, 4, 10), torch.zeros(3), alpha)


@pytest.mark.gpu
def test_kernel_agrees_with_the_reference_on_gpu(on_cuda):
    found = [dict(zip(case, on_cuda(case.values()), strict=True)) for case in cases()]
    assert_agree(run_kernel(found), found)
