"""A DiT block's gated residual add fused with its adaptive LayerNorm: `s = x + gate * delta`
(when given) and `layernorm(s) * (1 + scale) + shift`, one program per row, one read of each
input and one write of each output; and the add alone (`gated_residual`: a block's last,
which no norm follows inside it). A Triton kernel on CUDA, and the torch reference
(`reference`) it is tested against.

Why: token2wav's DiT (`omniflow.families.qwen2_5_omni.token2wav_dit`) runs 36 passes of 22 blocks
a window, and a block's two modulated norms and two gated residual adds are, in transformers'
ops, a dozen elementwise kernels over a few hundred kilobytes each. On an H200 a stream's
first window (36 codes, one request, replayed from a CUDA graph) launched 37,785 kernels
for 100 ms of GPU time, 2.6 us each (docs/benchmarks-log.md, "token2wav on fused
kernels"): launches, not bytes or FLOPs, bound it. The kernel takes the add before a norm
and the modulation after it into the norm's one pass.

Layout: `x` and `delta` are `[R, D]` (rows of one batch row's sequence contiguous, in batch
order); `shift` and `scale` are `[M, D]` views (e.g. chunks of the adaLN product) sharing
one row stride, where M divides R and row r takes modulation row `r // (R // M)` (M = 1: one
modulation for every row, as for a time embedding shared by the batch; M = R: per token, as
Wan2.2-TI2V's); `gate` is `[G, D]` the same way with its own G and stride (Wan's norm
before cross-attention is a fixed affine, M = 1, after a residual gated per batch row).

Numerics are transformers' `DiTDecoderLayer` in the input dtype: `gate * delta` rounded,
the sum rounded, the norm in float32 rounded, `1 + scale` rounded, the product rounded,
plus `shift` rounded. With `round_once` they are Wan's (`WanTransformerBlock`: float32
modulation, `FP32LayerNorm`): everything in float32, the sum and the output each rounded
once to the input dtype. The kernel computes the mean and variance in another order than
torch's `layer_norm`, so an output can differ from the reference by a step of the dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omniflow.errors import OmniflowError
from omniflow.kernels.triton_guard import jit, on_triton, tl, triton


class AdaNormError(OmniflowError):
    """Adaptive-norm inputs of mismatched shapes."""


@jit
def _ada_norm_kernel(
    x_ptr, delta_ptr, gate_ptr, shift_ptr, scale_ptr, sum_ptr, out_ptr,
    D, rows_per_modulation, rows_per_gate, eps, x_stride, delta_stride, mod_stride,
    gate_stride, sum_stride, out_stride,
    HAS_DELTA: tl.constexpr, ROUND_ONCE: tl.constexpr, NORM: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    mod = (row // rows_per_modulation) * mod_stride
    offs = tl.arange(0, BLOCK)
    inside = offs < D
    x = tl.load(x_ptr + row * x_stride + offs, mask=inside, other=0.0)
    dtype = x.dtype
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * delta_stride + offs, mask=inside, other=0.0)
        gate = tl.load(
            gate_ptr + (row // rows_per_gate) * gate_stride + offs, mask=inside, other=0.0
        )
        gated = gate.to(tl.float32) * delta.to(tl.float32)
        if not ROUND_ONCE:
            gated = gated.to(dtype).to(tl.float32)
        x = (x.to(tl.float32) + gated).to(dtype)
        tl.store(sum_ptr + row * sum_stride + offs, x, mask=inside)
    if NORM:
        xf = x.to(tl.float32)
        mean = tl.sum(xf, 0) / D
        centred = tl.where(inside, xf - mean, 0.0)
        variance = tl.sum(centred * centred, 0) / D
        normed = centred * (1.0 / tl.sqrt(variance + eps))
        scale = tl.load(scale_ptr + mod + offs, mask=inside, other=0.0).to(tl.float32)
        shift = tl.load(shift_ptr + mod + offs, mask=inside, other=0.0).to(tl.float32)
        if ROUND_ONCE:
            out = normed * (1.0 + scale) + shift
        else:
            factor = (1.0 + scale).to(dtype).to(tl.float32)
            out = (normed.to(dtype).to(tl.float32) * factor).to(dtype).to(tl.float32) + shift
        tl.store(out_ptr + row * out_stride + offs, out.to(dtype), mask=inside)


def _rows_per(name: str, t: torch.Tensor, rows: int, width: int) -> int:
    """Rows of x per row of the modulation `t` (`[M, D]`, M dividing R)."""
    if t.dim() != 2 or t.shape[1] != width or t.stride(1) != 1:
        raise AdaNormError(f"{name} must be [M, {width}] with contiguous rows")
    if t.shape[0] == 0 or rows % t.shape[0]:
        raise AdaNormError(f"{t.shape[0]} {name} rows for {rows} rows (M must divide R)")
    return rows // t.shape[0]


def _check_sum(x, delta, gate) -> int:
    """Rows of x per gate row (x and delta checked; none given: 1)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise AdaNormError(f"x must be [R, D] with contiguous rows, not {list(x.shape)}")
    if (delta is None) != (gate is None):
        raise AdaNormError("delta and gate come together")
    if delta is None:
        return 1
    if delta.shape != x.shape or delta.stride(1) != 1:
        raise AdaNormError(f"delta {list(delta.shape)} is not x's {list(x.shape)}")
    return _rows_per("gate", gate, *x.shape)


def _check(x, shift, scale, delta, gate) -> tuple[int, int]:
    """Rows per modulation row, and per gate row."""
    per_gate = _check_sum(x, delta, gate)
    per = _rows_per("shift", shift, *x.shape)
    if scale.shape != shift.shape or scale.stride() != shift.stride():
        raise AdaNormError("shift and scale must be [M, D] views of one stride")
    return per, per if gate is None else per_gate


def ada_norm_triton(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    delta: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    eps: float = 1e-6,
    round_once: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layernorm(s) * (1 + scale) + shift, s) with the Triton kernel, where s = x + gate *
    delta, or x without a delta."""
    per, per_gate = _check(x, shift, scale, delta, gate)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    total = torch.empty_like(out) if delta is not None else x
    _launch(x, delta, gate, shift, scale, total, out, per, per_gate, eps, round_once, True)
    return out, total


def _launch(x, delta, gate, shift, scale, total, out, per, per_gate, eps, round_once, norm):
    rows, width = x.shape
    if rows:
        gate = shift if gate is None else gate
        _ada_norm_kernel[(rows,)](
            x, x if delta is None else delta, gate, shift, scale, total, out, width, per,
            per_gate, eps, x.stride(0), 0 if delta is None else delta.stride(0),
            shift.stride(0), gate.stride(0), total.stride(0), out.stride(0),
            HAS_DELTA=delta is not None, ROUND_ONCE=round_once, NORM=norm,
            BLOCK=triton.next_power_of_2(width), num_warps=4 if width <= 2048 else 8,
        )  # fmt: skip


def reference(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    delta: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    eps: float = 1e-6,
    round_once: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' DiTDecoderLayer ops, in its order: `hidden + gate * delta`, then
    `norm(hidden) * (1 + scale) + shift`; with `round_once`, Wan's: both in float32, each
    rounded once to x's dtype."""
    per, per_gate = _check(x, shift, scale, delta, gate)
    width = x.shape[1]
    if round_once:
        shift, scale = shift.float(), scale.float()
        gate = None if gate is None else gate.float()
    total = x if delta is None else _sum_reference(x, delta, gate, per_gate, round_once)
    normed = F.layer_norm(total.float() if round_once else total, (width,), eps=eps)
    scale, shift = scale.repeat_interleave(per, 0), shift.repeat_interleave(per, 0)
    out = normed * (1 + scale) + shift
    return out.to(x.dtype), total


def _sum_reference(x, delta, gate, per_gate: int, round_once: bool) -> torch.Tensor:
    gated = gate.repeat_interleave(per_gate, 0) * delta
    return (x.float() + gated).to(x.dtype) if round_once else x + gated.to(x.dtype)


def ada_norm(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    delta: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    eps: float = 1e-6,
    round_once: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on CUDA (and under Triton's interpreter), the reference elsewhere."""
    run = ada_norm_triton if on_triton(x) else reference
    return run(x, shift, scale, delta, gate, eps, round_once)


# --- the gated residual add alone ------------------------------------------------------------
# A block's last add, which no norm follows inside the block: Wan2.2's
# `(x.float() + out.float() * gate).type_as(x)` made five elementwise passes through float32
# temporaries over the video's tokens (~11 GB a block of A14B's guided pair at 832x480x81);
# the kernel above, its norm off, makes one.


def gated_residual_triton(
    x: torch.Tensor, delta: torch.Tensor, gate: torch.Tensor, round_once: bool = False
) -> torch.Tensor:
    """`x + gate * delta` (ada_norm's sum, no norm) with the Triton kernel."""
    per_gate = _check_sum(x, delta, gate)
    total = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, delta, gate, gate, gate, total, total, 1, per_gate, 0.0, round_once, False)
    return total


def gated_residual_reference(
    x: torch.Tensor, delta: torch.Tensor, gate: torch.Tensor, round_once: bool = False
) -> torch.Tensor:
    """`x + gate * delta` as `reference` adds it."""
    per_gate = _check_sum(x, delta, gate)
    return _sum_reference(x, delta, gate.float() if round_once else gate, per_gate, round_once)


def gated_residual(
    x: torch.Tensor, delta: torch.Tensor, gate: torch.Tensor, round_once: bool = False
) -> torch.Tensor:
    """The kernel on CUDA (and under Triton's interpreter), the reference elsewhere."""
    run = gated_residual_triton if on_triton(x) else gated_residual_reference
    return run(x, delta, gate, round_once)
