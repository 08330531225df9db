"""Residual add fused with RMSNorm, for the AR decode step: `s = x + residual` (when given)
and `weight * rmsnorm(s)`, one program per row, one read of each input and one write of
each output. A Triton kernel on CUDA, and the torch reference (`reference`) it is tested
against.

Why: in a decode step the hidden state is `[B, H]` with B <= 32, so each op of HF's RMSNorm
(upcast, square, mean, add eps, rsqrt, scale, downcast, times the weight: eight kernels)
and the residual add before it are a kernel launch over a few kilobytes: two norms and two
adds were 18 of the ~42 kernels per layer of the graph-captured decode step
(`omniflow.backends.static_decode`). Measured on an H200 (docs/benchmarks-log.md, "AR decode
steps"), this kernel with `rope_cache` and `silu_mul` took a layer to 9 launches and the
real-size thinker's replay from 6.89 to 6.80 ms: launches were not what bounded it.

The residual may also come as float32 partial sums `[S, B, H]` (a split matrix product's,
`omniflow.kernels.skinny_matmul`), or as partials in the input dtype (a MoE layer's k
weighted expert outputs, `omniflow.kernels.fused_moe`, `[k, B, H]` with any strides): the
kernel loads them as one `[S, H]` tile, so their reads overlap (read one after another,
the talker's 49 norms took 229 us of a decode step where they take 88 without partial sums
and 118 with them in one tile, on an H200), adds them up in float32 and rounds the total
to the input dtype, as the product's own output (or torch's `sum` over the k) would have
been, before the add. One program holds at most PARTIAL_ELEMENTS of them (`most_parts`).

Numerics are HF's `Qwen2RMSNorm` (and `LlamaRMSNorm`): the sum is rounded to the input
dtype (as the bf16 add does), then upcast to float32, `x * rsqrt(mean(x^2) + eps)` in
float32, rounded to the input dtype, times the weight in float32 and rounded. The kernel
sums the squares in a different order than torch's mean, so a row can differ from the
reference by one step of the output dtype; `reference` performs HF's ops in their order.
"""

from __future__ import annotations

import torch

from omniflow.errors import OmniflowError
from omniflow.kernels.triton_guard import dependent_launch, gdc_enter, jit, tl, triton

# The most partial-sum values one program loads at once (`most_parts`).
PARTIAL_ELEMENTS = 16384


class NormError(OmniflowError):
    """Norm inputs of mismatched shapes."""


@jit
def _add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, H, eps, parts,
    x_stride, residual_part_stride, residual_stride, out_stride, sum_stride,
    HAS_RESIDUAL: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(GDC)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    inside = offs < H
    x = tl.load(x_ptr + row * x_stride + offs, mask=inside, other=0.0)
    if HAS_RESIDUAL:
        part = tl.arange(0, PARTS)[:, None]
        where = residual_ptr + part * residual_part_stride + row * residual_stride + offs[None, :]
        r = tl.load(where, mask=(part < parts) & inside[None, :], other=0.0)
        r = tl.sum(r.to(tl.float32), 0).to(x.dtype)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * sum_stride + offs, x, mask=inside)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, 0) / H
    normed = (xf * (1.0 / tl.sqrt(variance + eps))).to(x.dtype)
    w = tl.load(weight_ptr + offs, mask=inside, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * out_stride + offs, out.to(out_ptr.dtype.element_ty), mask=inside)


def _check(x, residual, weight) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise NormError(f"x must be [B, H] and weight [H]: {list(x.shape)}, {list(weight.shape)}")
    if residual is None:
        return
    partial = residual.dim() == 3 and residual.dtype in (torch.float32, x.dtype)
    if residual.shape[-2:] != x.shape or (residual.dtype != x.dtype and not partial):
        raise NormError(
            f"residual {list(residual.shape)} {residual.dtype} is neither x's shape and dtype"
            " nor partial sums [S, B, H] in float32 or x's dtype"
        )


def most_parts(width: int) -> int:
    """The most partial sums of rows `width` wide that the kernel takes as a residual."""
    return max(1, PARTIAL_ELEMENTS >> (width - 1).bit_length())


def _total(residual: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The residual, its partial sums added up and rounded to `dtype`."""
    return residual if residual.dim() == 2 else residual.sum(0).to(dtype)


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(x + residual), x + residual) with the Triton kernel; without a
    residual, (weight * rmsnorm(x), x). Rows may be strided; the last dim is contiguous. The
    residual may be partial sums `[S, B, H]` (see the module docstring)."""
    _check(x, residual, weight)
    rows, width = x.shape
    out = torch.empty(rows, width, dtype=weight.dtype, device=x.device)
    total = torch.empty_like(x) if residual is not None else x
    parts = x[None] if residual is None else residual[None] if residual.dim() == 2 else residual
    if parts.shape[0] > most_parts(width):
        raise NormError(f"{parts.shape[0]} partial sums of {width}: at most {most_parts(width)}")
    block = triton.next_power_of_2(width)
    held = triton.next_power_of_2(parts.shape[0]) * block
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x, parts, weight, out, total, width, eps, parts.shape[0],
            x.stride(0), parts.stride(0), parts.stride(1), out.stride(0), total.stride(0),
            HAS_RESIDUAL=residual is not None, PARTS=held // block, BLOCK=block,
            num_warps=4 if held <= 2048 else 8, **dependent_launch(x),
        )  # fmt: skip
    return out, total


def reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's residual add and RMSNorm, op by op."""
    _check(x, residual, weight)
    total = x if residual is None else x + _total(residual, x.dtype)
    hidden = total.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(total.dtype), total


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on CUDA, the reference elsewhere."""
    if x.is_cuda and triton is not None:
        return add_rms_norm_triton(x, residual, weight, eps)
    return reference(x, residual, weight, eps)
