"""Rotary position embedding of the first query and key head of a fused q/k/v projection's
output, from the checkpoint's interleaved layout, in place: token2wav's DiT attention
(transformers' `DiTAttention`) rotates only head 0 of q and k ("due to training process"),
after reordering that head's dims from interleaved `(x0, x1, x2, ...)` to half-split
`(x0, x2, ..., x1, x3, ...)`. A Triton kernel on CUDA, and the torch reference
(`reference`, transformers' own functions) it is tested against.

Why: transformers' version is, per tensor, two strided slices and a concatenation
(`deinterleave_head_dim`), the rotation's five elementwise kernels, and a copy back into
the head: some sixteen launches for q and k in each of a DiT pass's 22 blocks, 36 passes a
window (see `omniflow.kernels.ada_norm` for what launches cost there). Here: one.

Layout: `qkv` is `[R, 3 H d]` (q heads, k heads, v heads), rows may be strided; `cos`,
`sin` are `[R, d]` (the rotary embedding at each row's position, half-split layout). One
program per (row, q or k); it reads the head's d values before writing them back, so the
rotation in place is safe.

Numerics are transformers' `apply_rotary_pos_emb` in the input dtype: `x * cos` and
`rotate_half(x) * sin` each rounded to the dtype, their sum rounded; the kernel does each
product and the sum in float32 and rounds at the same points. Interpreted, that gives the
reference's float32 bits; compiled, a value can differ by a step of the dtype (on an H200,
bf16 values one step apart).
"""

from __future__ import annotations

import torch

from omniflow.errors import OmniflowError
from omniflow.kernels.triton_guard import jit, tl, triton


class DiTRopeError(OmniflowError):
    """Rotary inputs of mismatched shapes."""


@jit
def _rope_first_head_kernel(
    qkv_ptr, cos_ptr, sin_ptr, qkv_stride, cos_stride, k_offset, HALF: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    head = qkv_ptr + row * qkv_stride + tl.program_id(1) * k_offset
    i = tl.arange(0, HALF)
    even = tl.load(head + 2 * i)
    odd = tl.load(head + 2 * i + 1)
    dtype = even.dtype
    trig = row * cos_stride
    cos_lo = tl.load(cos_ptr + trig + i).to(tl.float32)
    cos_hi = tl.load(cos_ptr + trig + HALF + i).to(tl.float32)
    sin_lo = tl.load(sin_ptr + trig + i).to(tl.float32)
    sin_hi = tl.load(sin_ptr + trig + HALF + i).to(tl.float32)
    e, o = even.to(tl.float32), odd.to(tl.float32)
    # Half-split layout after the reorder: (even dims, odd dims); rotate_half -> (-odd, even).
    lo = (e * cos_lo).to(dtype).to(tl.float32) + (-o * sin_lo).to(dtype).to(tl.float32)
    hi = (o * cos_hi).to(dtype).to(tl.float32) + (e * sin_hi).to(dtype).to(tl.float32)
    tl.store(head + i, lo.to(dtype))
    tl.store(head + HALF + i, hi.to(dtype))


def _check(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> int:
    """The head dim."""
    rows = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] % (3 * heads) or qkv.stride(1) != 1:
        raise DiTRopeError(f"qkv {list(qkv.shape)} is not [R, 3 * {heads} heads * d]")
    d = qkv.shape[1] // (3 * heads)
    if d % 2 or d & (d - 1):
        raise DiTRopeError(f"head dim {d} is not an even power of two")
    for t in (cos, sin):
        if t.shape != (rows, d) or t.stride(1) != 1 or t.stride() != cos.stride():
            raise DiTRopeError(f"cos/sin must be [{rows}, {d}] of one stride, not {list(t.shape)}")
    return d


def rope_first_head_triton(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
) -> torch.Tensor:
    """`qkv` with head 0 of q and of k reordered and rotated, in place."""
    d = _check(qkv, cos, sin, heads)
    if qkv.shape[0]:
        _rope_first_head_kernel[(qkv.shape[0], 2)](
            qkv, cos, sin, qkv.stride(0), cos.stride(0), heads * d, HALF=d // 2, num_warps=1
        )
    return qkv


def reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' `deinterleave_head_dim` and `apply_rotary_pos_emb` on head 0, written
    back in place as `DiTAttention` does."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        apply_rotary_pos_emb,
        deinterleave_head_dim,
    )

    d = _check(qkv, cos, sin, heads)
    q, k = qkv[:, None, :d], qkv[:, None, heads * d : heads * d + d]
    q[:], k[:] = apply_rotary_pos_emb(deinterleave_head_dim(q), deinterleave_head_dim(k), cos, sin)
    return qkv


def rope_first_head(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
) -> torch.Tensor:
    """The kernel on CUDA, the reference elsewhere."""
    if qkv.is_cuda and triton is not None:
        return rope_first_head_triton(qkv, cos, sin, heads)
    return reference(qkv, cos, sin, heads)
