"""A DiT block's gated residual add fused with its adaptive LayerNorm: `s = x + gate * delta`
(when given) and `layernorm(s) * (1 + scale) + shift`, one program per row, one read of each
input and one write of each output. A Triton kernel on CUDA, and the torch reference
(`reference`) it is tested against.

Why: token2wav's DiT (`omniflow.families.qwen2_5_omni.token2wav_dit`) runs 36 passes of 22 blocks
a window, and a block's two modulated norms and two gated residual adds are, in transformers'
ops, a dozen elementwise kernels over a few hundred kilobytes each. On an H200 a stream's
first window (36 codes, one request, replayed from a CUDA graph) launched 37,785 kernels
for 100 ms of GPU time, 2.6 us each (docs/benchmarks-log.md, "token2wav on fused
kernels"): launches, not bytes or FLOPs, bound it. The kernel takes the add before a norm
and the modulation after it into the norm's one pass.

Layout: `x` and `delta` are `[R, D]` (rows of one batch row's sequence contiguous, in batch
order); `shift`, `scale` and `gate` are `[M, D]` views (e.g. chunks of the adaLN product)
sharing one row stride, where M divides R and row r takes modulation row `r // (R // M)`
(M = 1: one modulation for every row, as for a time embedding shared by the batch).

Numerics are transformers' `DiTDecoderLayer` in the input dtype: `gate * delta` rounded,
the sum rounded, the norm in float32 rounded, `1 + scale` rounded, the product rounded,
plus `shift` rounded. The kernel computes the mean and variance in another order than
torch's `layer_norm`, so an output can differ from the reference by a step of the dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omniflow.errors import OmniflowError
from omniflow.kernels.triton_guard import jit, tl, triton


class AdaNormError(OmniflowError):
    """Adaptive-norm inputs of mismatched shapes."""


@jit
def _ada_norm_kernel(
    x_ptr, delta_ptr, gate_ptr, shift_ptr, scale_ptr, sum_ptr, out_ptr,
    D, rows_per_modulation, eps, x_stride, delta_stride, mod_stride, sum_stride, out_stride,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    mod = (row // rows_per_modulation) * mod_stride
    offs = tl.arange(0, BLOCK)
    inside = offs < D
    x = tl.load(x_ptr + row * x_stride + offs, mask=inside, other=0.0)
    dtype = x.dtype
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * delta_stride + offs, mask=inside, other=0.0)
        gate = tl.load(gate_ptr + mod + offs, mask=inside, other=0.0)
        gated = (gate.to(tl.float32) * delta.to(tl.float32)).to(dtype)
        x = (x.to(tl.float32) + gated.to(tl.float32)).to(dtype)
        tl.store(sum_ptr + row * sum_stride + offs, x, mask=inside)
    xf = x.to(tl.float32)
    mean = tl.sum(xf, 0) / D
    centred = tl.where(inside, xf - mean, 0.0)
    variance = tl.sum(centred * centred, 0) / D
    normed = (centred * (1.0 / tl.sqrt(variance + eps))).to(dtype)
    scale = tl.load(scale_ptr + mod + offs, mask=inside, other=0.0)
    shift = tl.load(shift_ptr + mod + offs, mask=inside, other=0.0)
    factor = (1.0 + scale.to(tl.float32)).to(dtype)
    out = (normed.to(tl.float32) * factor.to(tl.float32)).to(dtype)
    out = out.to(tl.float32) + shift.to(tl.float32)
    tl.store(out_ptr + row * out_stride + offs, out.to(dtype), mask=inside)


def _check(x, shift, scale, delta, gate) -> int:
    """Rows per modulation row."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise AdaNormError(f"x must be [R, D] with contiguous rows, not {list(x.shape)}")
    rows, width = x.shape
    mods = [shift, scale] + ([] if delta is None else [gate])
    if (delta is None) != (gate is None):
        raise AdaNormError("delta and gate come together")
    if delta is not None and (delta.shape != x.shape or delta.stride(1) != 1):
        raise AdaNormError(f"delta {list(delta.shape)} is not x's {list(x.shape)}")
    m = shift.shape[0] if shift.dim() == 2 else 0
    for t in mods:
        if t.dim() != 2 or t.shape != (m, width) or t.stride() != shift.stride():
            raise AdaNormError(f"shift, scale and gate must be [M, {width}] views of one stride")
    if m == 0 or rows % m or shift.stride(1) != 1:
        raise AdaNormError(f"{m} modulation rows for {rows} rows (M must divide R)")
    return rows // m


def ada_norm_triton(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    delta: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layernorm(s) * (1 + scale) + shift, s) with the Triton kernel, where s = x + gate *
    delta, or x without a delta."""
    per = _check(x, shift, scale, delta, gate)
    rows, width = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    total = torch.empty_like(out) if delta is not None else x
    if rows:
        _ada_norm_kernel[(rows,)](
            x, x if delta is None else delta, shift if gate is None else gate, shift, scale,
            total, out, width, per, eps, x.stride(0), 0 if delta is None else delta.stride(0),
            shift.stride(0), total.stride(0), out.stride(0),
            HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(width),
            num_warps=4 if width <= 2048 else 8,
        )  # fmt: skip
    return out, total


def reference(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    delta: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' DiTDecoderLayer ops, in its order: `hidden + gate * delta`, then
    `norm(hidden) * (1 + scale) + shift`."""
    per = _check(x, shift, scale, delta, gate)
    rows, width = x.shape
    total = x.view(-1, per, width)
    if delta is not None:
        total = total + gate[:, None] * delta.view(-1, per, width)
    normed = F.layer_norm(total, (width,), eps=eps)
    out = normed * (1 + scale[:, None]) + shift[:, None]
    return out.reshape(rows, width), total.reshape(rows, width)


def ada_norm(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    delta: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on CUDA, the reference elsewhere."""
    if x.is_cuda and triton is not None:
        return ada_norm_triton(x, shift, scale, delta, gate, eps)
    return reference(x, shift, scale, delta, gate, eps)
