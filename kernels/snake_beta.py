"""SnakeBeta in one pass: `x + sin(x e^alpha)^2 / (e^beta + 1e-9)`, per channel, over `[B, C,
T]`. A Triton kernel on CUDA, the torch reference (`reference`, the activation's ops in
transformers' order) elsewhere, and the device functions the anti-aliased activation
(`anti_alias_snake`) computes its SnakeBeta with.

Why: torch runs the activation as eight kernels (two `exp`s of the parameters, the
product, `sin`, `pow`, the guard's add, the reciprocal's product, the sum), five of them
over the whole tensor. The 12 Hz speech tokenizer's decoder (Qwen3-TTS's code2wav) runs 29
of them a forward, from 1536 channels at 4 samples a frame to 96 at 1920: about 230 small
kernels of a window's graph, and at 64 streams on an H100 torch's elementwise kernels were
about two fifths of code2wav's GPU time (docs/benchmarks-log.md, "One torch thread a GPU
executor"). This kernel reads `x` once and writes the result once.

Numerics: float32 inside whatever `x`'s dtype; its `sin` is libdevice's `sinf` and its
`exp` Triton's, so it agrees with the reference to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch

from omniflow.errors import OmniflowError
from omniflow.kernels.timing import cuda_median_ms
from omniflow.kernels.triton_guard import jit, on_triton, tl, triton

# The guard against dividing by zero (transformers' SnakeBeta `no_div_by_zero`).
NO_DIV_BY_ZERO = 1e-9
BLOCK = 1024


class SnakeBetaError(OmniflowError):
    """An input or parameters of the wrong shape."""


@jit
def snake_parameters(alpha, beta, eps):
    """A channel's frequency `e^alpha` and inverse magnitude `1 / (e^beta + eps)`."""
    return tl.exp(alpha), tl.math.div_rn(1.0, tl.exp(beta) + eps)


@jit
def snake(u, frequency, inverse_magnitude):
    """SnakeBeta of `u` (float32) with its channel's `snake_parameters`."""
    wave = tl.sin(u * frequency)
    return u + inverse_magnitude * (wave * wave)


@jit
def _snake_beta_kernel(x_ptr, alpha_ptr, beta_ptr, out_ptr, n, C, T, eps, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    channel = (offsets // T) % C
    frequency, inverse_magnitude = snake_parameters(
        tl.load(alpha_ptr + channel, mask=inside, other=0.0),
        tl.load(beta_ptr + channel, mask=inside, other=0.0),
        eps,
    )
    x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    y = snake(x, frequency, inverse_magnitude)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=inside)


def _check(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> None:
    if x.dim() != 3:
        raise SnakeBetaError(f"x must be [B, C, T]: {list(x.shape)}")
    channels = x.shape[1]
    if alpha.shape != (channels,) or beta.shape != (channels,):
        raise SnakeBetaError(
            f"alpha and beta must be [C={channels}]: {list(alpha.shape)}, {list(beta.shape)}"
        )


def snake_beta_triton(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """The activation with the Triton kernel. `x` `[B, C, T]`; `alpha`, `beta` `[C]`, the
    parameters before their `exp`."""
    _check(x, alpha, beta)
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        _snake_beta_kernel[(triton.cdiv(n, BLOCK),)](
            x, alpha.float().contiguous(), beta.float().contiguous(), out, n,
            x.shape[1], x.shape[2], NO_DIV_BY_ZERO, BLOCK=BLOCK,
        )  # fmt: skip
    return out


def reference(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """transformers' SnakeBeta forward, op by op (Qwen2.5-Omni's, Qwen3-Omni's and the 12 Hz
    speech tokenizer's are one)."""
    _check(x, alpha, beta)
    frequency = torch.exp(alpha)[None, :, None]
    magnitude = torch.exp(beta)[None, :, None]
    return x + (1.0 / (magnitude + NO_DIV_BY_ZERO)) * torch.pow(torch.sin(x * frequency), 2)


def snake_beta(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """The kernel on CUDA (and under Triton's interpreter), the reference elsewhere."""
    return (snake_beta_triton if on_triton(x) else reference)(x, alpha, beta)


def benchmark(batch: int = 16, frames: int = 4, iters: int = 50) -> dict:
    """Median milliseconds of the kernel and the reference on CUDA at each of the 12 Hz
    decoder's SnakeBeta shapes for `batch` windows of `frames` frames (1536 channels at 4
    samples a frame, halved as the rate grows 8, 5, 4, 3 times, to 96 at 1920)."""
    times, channels, length = {}, 1536, 4 * frames
    for rate in (8, 5, 4, 3, None):
        x = torch.randn(batch, channels, length, device="cuda")
        inputs = (x, *(torch.randn(channels, device="cuda") / 4 for _ in range(2)))
        for name, fn in (("triton", snake_beta_triton), ("torch", reference)):
            times[channels, length, name] = cuda_median_ms(
                lambda fn=fn, inputs=inputs: fn(*inputs), iters
            )
        if rate is not None:
            channels, length = channels // 2, length * rate
    return times


if __name__ == "__main__":
    for (channels, length, name), ms in benchmark().items():
        print(f"C={channels} T={length} {name}: {ms:.4f} ms")
