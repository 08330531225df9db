"""An MMDiT attention's per-head RMSNorm of queries and keys, their rotary embedding, and the
placement of queries, keys and values into the joint sequence, in one pass over one
stream's merged q/k/v product: one program per token, every head at once. A Triton kernel
on CUDA, and the torch reference (`reference`) it is tested against.

Why: in a Qwen-Image block (`omniflow.families.qwen_image.fused_blocks`), diffusers runs, for
each of the image and text streams' queries and keys, RMSNorm as five elementwise kernels
with float32 intermediates, the complex-pair rotary as three more (a float32 copy, the
complex product, the cast back), then three concatenations into the joint sequence: at
1024x1024 with true CFG (2 x 4096 image tokens, 3072 wide) each of those passes moves 50 to
200 MB, some 2 GB a block where this kernel reads and writes 0.3 GB (43 us a call for the
image stream on an H200; docs/benchmarks-log.md, "Fused MMDiT blocks").

Layout: `qkv` is `[B * S, 3 * H * Dh]` (one stream's tokens, rows contiguous: the q, k and v
products side by side, each head's `Dh` values together); `freqs` `[S, Dh / 2]` complex (the
stream's rotary, diffusers' `freqs_cis`); `q`, `k`, `v` `[B, S_joint, H, Dh]` contiguous,
rows `offset .. offset + S` of each batch row written.

Numerics are diffusers' `RMSNorm` then `apply_rotary_emb_qwen(use_real=False)`: the mean
square in float32, the normalized value rounded to the weight's dtype, times the weight
(rounded), then each (even, odd) pair times the complex frequency in float32, rounded to the
output's dtype. With `across_heads` the norm is Wan's (`rms_norm_across_heads`,
`torch.nn.RMSNorm` over all of a token's heads, weights `[H * Dh]`): the mean square over
every head, the product in float32 rounded once; then the same rotation (Wan's real
`(cos, sin)` pairs are these complex frequencies).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omniflow.errors import OmniflowError
from omniflow.kernels.triton_guard import jit, on_triton, tl, triton


class QkNormRopeError(OmniflowError):
    """q/k/v, weights, frequencies or outputs of mismatched shapes."""


@jit
def _norm_rope(
    src, weight_ptr, dst, cos, sin, heads, dims, inside, width, H, eps,
    ACROSS_HEADS: tl.constexpr,
):  # fmt: skip
    x = tl.load(src + heads * width + dims, mask=inside, other=0.0).to(tl.float32)
    if ACROSS_HEADS:  # torch's RMSNorm over every head: float32 throughout, one rounding
        rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(x * x, 1), 0) / (H * width) + eps)
        weight = tl.load(weight_ptr + heads * width + dims, mask=inside, other=0.0)
        x = (x * rstd * weight.to(tl.float32)).to(weight.dtype)
    else:  # diffusers' RMSNorm of each head: rounded to the weight's dtype, then weighted
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / width + eps)
        weight = tl.load(weight_ptr + dims, mask=dims < width, other=0.0)
        wtype = weight.dtype
        x = ((x * rstd[:, None]).to(wtype).to(tl.float32) * weight.to(tl.float32)).to(wtype)
    # Pairs (even, odd) as complex numbers: split the head's row in registers, rotate,
    # interleave back. Loading and storing evens and odds as two strided halves instead was
    # 10x slower on an H200 (445 against 43 us a call at 2 x 4096 tokens, 24 heads of 128).
    re, im = tl.split(tl.reshape(x.to(tl.float32), (x.shape[0], x.shape[1] // 2, 2)))
    rotated = tl.join(re * cos - im * sin, re * sin + im * cos)
    out = tl.reshape(rotated, (x.shape[0], x.shape[1])).to(dst.dtype.element_ty)
    tl.store(dst + heads * width + dims, out, mask=inside)


@jit
def _qk_norm_rope_kernel(
    qkv_ptr, q_weight_ptr, k_weight_ptr, freqs_ptr, q_ptr, k_ptr, v_ptr,
    S, S_joint, offset, H, D, qkv_stride, eps,
    HEADS: tl.constexpr, WIDTH: tl.constexpr, ACROSS_HEADS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    b, s = row // S, row % S
    heads = tl.arange(0, HEADS)[:, None]
    dims = tl.arange(0, WIDTH)[None, :]
    inside = (heads < H) & (dims < D)
    pairs = tl.arange(0, WIDTH // 2)[None, :]
    cos = tl.load(freqs_ptr + s * D + 2 * pairs, mask=pairs < D // 2, other=0.0)
    sin = tl.load(freqs_ptr + s * D + 2 * pairs + 1, mask=pairs < D // 2, other=0.0)
    src = qkv_ptr + row * qkv_stride
    out = (b * S_joint + offset + s) * H * D
    _norm_rope(
        src, q_weight_ptr, q_ptr + out, cos, sin, heads, dims, inside, D, H, eps, ACROSS_HEADS
    )
    _norm_rope(
        src + H * D, k_weight_ptr, k_ptr + out, cos, sin, heads, dims, inside, D, H, eps,
        ACROSS_HEADS,
    )  # fmt: skip
    values = tl.load(src + 2 * H * D + heads * D + dims, mask=inside, other=0.0)
    tl.store(v_ptr + out + heads * D + dims, values, mask=inside)


def _check(qkv, q_weight, k_weight, freqs, q, k, v, offset, across_heads) -> int:
    """Tokens of the stream."""
    batch, joint, heads, width = q.shape
    if k.shape != q.shape or v.shape != q.shape or not all(t.is_contiguous() for t in (q, k, v)):
        raise QkNormRopeError("q, k and v must be contiguous [B, S_joint, H, Dh] of one shape")
    if qkv.dim() != 2 or qkv.shape[1] != 3 * heads * width or qkv.stride(1) != 1:
        raise QkNormRopeError(f"qkv must be [B * S, {3 * heads * width}], not {list(qkv.shape)}")
    normed = heads * width if across_heads else width
    if width % 2 or q_weight.shape != (normed,) or k_weight.shape != (normed,):
        raise QkNormRopeError(f"the norms' weights must be [{normed}] with Dh even")
    tokens = qkv.shape[0] // batch
    if tokens * batch != qkv.shape[0] or freqs.shape != (tokens, width // 2):
        raise QkNormRopeError(f"freqs must be [{tokens}, {width // 2}], not {list(freqs.shape)}")
    if not 0 <= offset <= joint - tokens:
        raise QkNormRopeError(f"{tokens} tokens at {offset} do not fit {joint}")
    return tokens


def qk_norm_rope_triton(
    qkv, q_weight, k_weight, freqs, q, k, v, offset: int, eps: float, across_heads: bool = False
) -> None:
    tokens = _check(qkv, q_weight, k_weight, freqs, q, k, v, offset, across_heads)
    batch, joint, heads, width = q.shape
    if qkv.shape[0]:
        _qk_norm_rope_kernel[(qkv.shape[0],)](
            qkv, q_weight, k_weight, torch.view_as_real(freqs.contiguous()), q, k, v,
            tokens, joint, offset, heads, width, qkv.stride(0), eps,
            HEADS=triton.next_power_of_2(heads), WIDTH=max(2, triton.next_power_of_2(width)),
            ACROSS_HEADS=across_heads,
        )  # fmt: skip


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, across_heads: bool):
    if across_heads:  # torch.nn.RMSNorm over [H * Dh], as Wan's `rms_norm_across_heads`
        return F.rms_norm(x.flatten(-2), (weight.shape[0],), weight, eps).view(x.shape)
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        x = x.to(weight.dtype)
    return x * weight


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs.unsqueeze(1)).flatten(3).type_as(x)


def reference(
    qkv, q_weight, k_weight, freqs, q, k, v, offset: int, eps: float, across_heads: bool = False
) -> None:
    """diffusers' ops: RMSNorm, apply_rotary_emb_qwen, and the joint sequence's concatenation
    as copies into `q`, `k`, `v`."""
    tokens = _check(qkv, q_weight, k_weight, freqs, q, k, v, offset, across_heads)
    batch, _, heads, width = q.shape
    query, key, value = qkv.view(batch, tokens, 3, heads, width).unbind(2)
    rows = slice(offset, offset + tokens)
    q[:, rows] = _rotate(_rms_norm(query, q_weight, eps, across_heads), freqs)
    k[:, rows] = _rotate(_rms_norm(key, k_weight, eps, across_heads), freqs)
    v[:, rows] = value


def qk_norm_rope(
    qkv, q_weight, k_weight, freqs, q, k, v, offset: int, eps: float, across_heads: bool = False
) -> None:
    """The kernel on CUDA (and under Triton's interpreter), the reference elsewhere."""
    run = qk_norm_rope_triton if on_triton(qkv) else reference
    run(qkv, q_weight, k_weight, freqs, q, k, v, offset, eps, across_heads)
