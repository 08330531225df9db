"""A DiT block's last gated residual add, `x + gate * delta`, in one pass: one read of each
input, one write. A Triton kernel on CUDA, and the torch reference (`reference`) it is
tested against.

Why: a block ends with its MLP's output added to the residual stream under the block's gate.
In diffusers' Wan2.2 block that is `(x.float() + out.float() * gate).type_as(x)`: five
elementwise passes through float32 temporaries over the video's tokens, ~38 bytes moved per
element where one pass moves 6 (A14B at 832x480x81, a guided pair: 65,520 rows of 5,120,
~11 GB a block). Qwen-Image's, `x + gate * out` in bf16, is two passes. (The next block's
norm is `ada_norm`'s, which takes the add before it; this is the add no norm follows inside
the block.)

Layout: `x` and `delta` are `[R, D]` with contiguous rows; `gate` is `[G, D]` with
contiguous rows and its own row stride (e.g. a chunk of the adaLN product), G dividing R:
row r takes gate row `r // (R // G)` (G = batch rows for a gate per request, G = R per
token). Numerics: `gate * delta` rounded to x's dtype, then the sum rounded (diffusers'
bf16 ops, Qwen-Image's); with `round_once` both in float32 and the sum rounded once (Wan's).
"""

from __future__ import annotations

import torch

from omniflow.errors import OmniflowError
from omniflow.kernels.triton_guard import jit, on_triton, tl, triton

BLOCK = 1024  # columns a program adds


class GatedResidualError(OmniflowError):
    """Gated residual inputs of mismatched shapes."""


@jit
def _gated_residual_kernel(
    x_ptr, delta_ptr, gate_ptr, out_ptr, D, rows_per_gate, x_stride, delta_stride,
    gate_stride, out_stride, ROUND_ONCE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < D
    x = tl.load(x_ptr + row * x_stride + offs, mask=inside, other=0.0)
    delta = tl.load(delta_ptr + row * delta_stride + offs, mask=inside, other=0.0)
    gate = tl.load(gate_ptr + (row // rows_per_gate) * gate_stride + offs, mask=inside, other=0.0)
    gated = gate.to(tl.float32) * delta.to(tl.float32)
    if not ROUND_ONCE:
        gated = gated.to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * out_stride + offs, (x.to(tl.float32) + gated).to(x.dtype), mask=inside)


def _rows_per_gate(x: torch.Tensor, delta: torch.Tensor, gate: torch.Tensor) -> int:
    if x.dim() != 2 or x.stride(1) != 1:
        raise GatedResidualError(f"x must be [R, D] with contiguous rows, not {list(x.shape)}")
    if delta.shape != x.shape or delta.stride(1) != 1:
        raise GatedResidualError(f"delta {list(delta.shape)} is not x's {list(x.shape)}")
    rows, width = x.shape
    if gate.dim() != 2 or gate.shape[1] != width or gate.stride(1) != 1:
        raise GatedResidualError(f"gate must be [G, {width}] with contiguous rows")
    if gate.shape[0] == 0 or rows % gate.shape[0]:
        raise GatedResidualError(f"{gate.shape[0]} gate rows for {rows} rows (G must divide R)")
    return rows // gate.shape[0]


def gated_residual_triton(
    x: torch.Tensor, delta: torch.Tensor, gate: torch.Tensor, round_once: bool = False
) -> torch.Tensor:
    """`x + gate * delta` with the Triton kernel."""
    per = _rows_per_gate(x, delta, gate)
    rows, width = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if rows:
        _gated_residual_kernel[(rows, triton.cdiv(width, BLOCK))](
            x, delta, gate, out, width, per, x.stride(0), delta.stride(0), gate.stride(0),
            out.stride(0), ROUND_ONCE=round_once, BLOCK=BLOCK, num_warps=4,
        )  # fmt: skip
    return out


def reference(
    x: torch.Tensor, delta: torch.Tensor, gate: torch.Tensor, round_once: bool = False
) -> torch.Tensor:
    """diffusers' ops: `x + gate * delta` in x's dtype, or with `round_once` Wan's
    `(x.float() + delta.float() * gate)` rounded to x's dtype."""
    gate = gate.repeat_interleave(_rows_per_gate(x, delta, gate), 0)
    if round_once:
        return (x.float() + delta.float() * gate.float()).to(x.dtype)
    return x + gate.to(x.dtype) * delta


def gated_residual(
    x: torch.Tensor, delta: torch.Tensor, gate: torch.Tensor, round_once: bool = False
) -> torch.Tensor:
    """The kernel on CUDA (and under Triton's interpreter), the reference elsewhere."""
    run = gated_residual_triton if on_triton(x) else reference
    return run(x, delta, gate, round_once)


if __name__ == "__main__":  # against the reference at A14B's pair (half the rows: 2 x 16,380)
    from omniflow.kernels.timing import cuda_median_ms

    g = torch.Generator(device="cuda").manual_seed(0)
    x, delta = (torch.randn(32760, 5120, device="cuda", generator=g).bfloat16() for _ in "xd")
    gate = torch.randn(2, 5120, device="cuda", generator=g)
    for name, run in (("kernel", gated_residual_triton), ("reference", reference)):
        ms = cuda_median_ms(lambda run=run: run(x, delta, gate, round_once=True), 50)
        print(f"{name:>10} {ms:8.3f} ms  {3 * x.numel() * 2 / ms / 1e9:7.1f} GB/s (3 tensors)")
    diff = gated_residual_triton(x, delta, gate, True).float() - reference(x, delta, gate, True)
    print(f"max |kernel - reference| {diff.abs().max().item():.3g}")
