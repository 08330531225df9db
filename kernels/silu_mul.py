"""SwiGLU's elementwise half, `silu(gate) * up`, from the fused gate/up projection's
output `[B, 2 I]` (gate columns first) to `[B, I]`, in one pass. A Triton kernel on CUDA, and
the torch reference (`reference`) it is tested against.

Why: HF's MLP runs `act_fn(gate_proj(x)) * up_proj(x)`: two projections and two
elementwise kernels. With the projections fused into one matrix product (one launch, one
read of x), the activation and product are one more: a decode step's MLP goes from five
kernels to three (see `omniflow.backends.static_decode`; the measured effect of the three
fused kernels together is in docs/benchmarks-log.md, "AR decode steps").

Numerics: the activation `g / (1 + exp(-g))` in float32 rounded to the input dtype, then
the product in float32 rounded, as torch computes `silu` and `*` on bf16. The kernel's
`exp` is Triton's, so a value can differ from torch's by one step of the dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omniflow.errors import OmniflowError
from omniflow.kernels.triton_guard import jit, tl, triton

BLOCK = 1024


class ActivationError(OmniflowError):
    """An input that is not `[B, 2 I]`."""


@jit
def _silu_mul_kernel(x_ptr, out_ptr, width, x_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < width
    gate = tl.load(x_ptr + row * x_stride + offs, mask=inside, other=0.0)
    up = tl.load(x_ptr + row * x_stride + width + offs, mask=inside, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * out_stride + offs, out.to(gate.dtype), mask=inside)


def _width(x: torch.Tensor) -> int:
    if x.dim() != 2 or x.shape[1] % 2:
        raise ActivationError(f"expected [B, 2 I], got {list(x.shape)}")
    return x.shape[1] // 2


def silu_mul_triton(x: torch.Tensor) -> torch.Tensor:
    width = _width(x)
    out = torch.empty(x.shape[0], width, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        grid = (x.shape[0], triton.cdiv(width, BLOCK))
        _silu_mul_kernel[grid](x, out, width, x.stride(0), out.stride(0), BLOCK=BLOCK)
    return out


def reference(x: torch.Tensor) -> torch.Tensor:
    width = _width(x)
    return F.silu(x[:, :width]) * x[:, width:]


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """The kernel on CUDA, the reference elsewhere."""
    if x.is_cuda and triton is not None:
        return silu_mul_triton(x)
    return reference(x)
