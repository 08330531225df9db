"""Rotary position embedding of a decode step's queries and keys, fused with writing its
keys and values into a static KV cache: one kernel from the fused q/k/v projection's output
to the rotated queries and the cache's new column. A Triton kernel on CUDA, and the torch
reference (`reference`) it is tested against.

Why: in HF's attention the rotation is five elementwise kernels per tensor (`q * cos`,
`rotate_half` as a negation and a concatenation, `* sin`, the sum), ten for q and k, and
the static cache's write two scatters more: twelve of the ~42 launches per layer of the
graph-captured decode step (`omniflow.backends.static_decode`), each over a few kilobytes.
With `rms_norm` and `silu_mul` it takes a layer to 9 launches; on an H200 that moved the
real-size replay by 1.5 % (docs/benchmarks-log.md, "AR decode steps").

Layout: `qkv` is `[B, (Hq + 2 Hkv) * d]`, the q heads then the k heads then the v heads (the
fused projection's output); `cos`, `sin` are `[B, d]` (HF's rotary embedding at each row's
position); the cache is `[slots, Hkv, columns, d]` (one layer's), row b writing column
`min(filled[b], columns - 1)` of slot b, or of slot `slots[b]` where given (a prefill's
rows are a prompt's positions, many to a slot). One program per (row, head): q heads write
the rotated query to `q_out[b, h]`, kv heads write the rotated key and the value to the
cache.

Numerics are HF's `apply_rotary_pos_emb` in the input dtype: `q * cos` and
`rotate_half(q) * sin` each rounded to the dtype, then their sum rounded; the kernel does
each product and the sum in float32 and rounds at the same three points, so it gives the
same bits.

Per-head q/k RMSNorm (Qwen3's `q_norm` and `k_norm`, before the rotation): given their
weights `[d]` (`q_norm`, `k_norm`) and `eps`, each q and k head is normalized first, as
Qwen3's RMSNorm does it: the mean square in float32, `x * rsqrt(mean + eps)` rounded to the
dtype, times the weight, rounded. A program holds its whole head, so the norm costs no
extra pass: it normalizes the head's values and their rotary partners with the same scale.
"""

from __future__ import annotations

import torch

from omniflow.errors import OmniflowError
from omniflow.kernels.triton_guard import dependent_launch, gdc_enter, jit, tl, triton


class RopeError(OmniflowError):
    """Rotary inputs of mismatched shapes."""


@jit
def _rotate(x, other, cos, sin):
    """`x * cos + other * sin` (other: the partners, sign applied) rounded as HF rounds."""
    a = (x.to(tl.float32) * cos).to(x.dtype)
    b = (other.to(tl.float32) * sin).to(x.dtype)
    return (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)


@jit
def _head(src, norm_ptr, offs, partner, sign, inside, eps, D: tl.constexpr, QK_NORM: tl.constexpr):
    """A q or k head's values and their rotary partners (times `sign`), RMS-normalized by
    `norm_ptr`'s weights first where QK_NORM."""
    x = tl.load(src + offs, mask=inside, other=0.0)
    other = tl.load(src + partner, mask=inside, other=0.0)
    if QK_NORM:
        wide = x.to(tl.float32)
        scale = 1.0 / tl.sqrt(tl.sum(wide * wide, 0) / D + eps)
        weight = tl.load(norm_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        partner_weight = tl.load(norm_ptr + partner, mask=inside, other=0.0).to(tl.float32)
        x = ((wide * scale).to(x.dtype).to(tl.float32) * weight).to(x.dtype)
        other = (other.to(tl.float32) * scale).to(x.dtype).to(tl.float32) * partner_weight
        other = other.to(x.dtype)
    return x, other.to(tl.float32) * sign


@jit
def _rope_cache_kernel(
    qkv_ptr, cos_ptr, sin_ptr, filled_ptr, slots_ptr, q_ptr, keys_ptr, values_ptr,
    q_norm_ptr, k_norm_ptr, eps,
    qkv_stride, cos_stride, q_stride_b, q_stride_h,
    cache_stride_s, cache_stride_h, cache_stride_c, columns,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    HAS_SLOTS: tl.constexpr, QK_NORM: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(GDC)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    inside = offs < D
    half = D // 2
    partner = tl.where(offs < half, offs + half, offs - half)
    sign = tl.where(offs < half, -1.0, 1.0)
    cos = tl.load(cos_ptr + row * cos_stride + offs, mask=inside, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + row * cos_stride + offs, mask=inside, other=0.0).to(tl.float32)
    base = qkv_ptr + row * qkv_stride
    if head < Q_HEADS:
        x, other = _head(base + head * D, q_norm_ptr, offs, partner, sign, inside, eps, D, QK_NORM)
        q = _rotate(x, other, cos, sin)
        tl.store(q_ptr + row * q_stride_b + head * q_stride_h + offs, q, mask=inside)
    else:
        kv = head - Q_HEADS
        column = tl.minimum(tl.load(filled_ptr + row), columns - 1)
        slot = row
        if HAS_SLOTS:
            slot = tl.load(slots_ptr + row)
        at = slot * cache_stride_s + kv * cache_stride_h + column * cache_stride_c + offs
        x, other = _head(
            base + (Q_HEADS + kv) * D, k_norm_ptr, offs, partner, sign, inside, eps, D, QK_NORM
        )
        tl.store(keys_ptr + at, _rotate(x, other, cos, sin), mask=inside)
        v = tl.load(base + (Q_HEADS + KV_HEADS + kv) * D + offs, mask=inside, other=0.0)
        tl.store(values_ptr + at, v, mask=inside)


def _check(qkv, cos, sin, filled, keys, values, q_heads, kv_heads, slots, norms) -> int:
    rows = qkv.shape[0]
    d = keys.shape[-1]
    if qkv.shape != (rows, (q_heads + 2 * kv_heads) * d) or d % 2:
        raise RopeError(f"qkv {list(qkv.shape)} is not [B, (Hq + 2 Hkv) * d] for d = {d}")
    if cos.shape != (rows, d) or sin.shape != cos.shape or filled.shape != (rows,):
        raise RopeError(f"cos/sin must be [{rows}, {d}] and filled [{rows}]")
    if slots is not None and slots.shape != (rows,):
        raise RopeError(f"slots must be [{rows}], not {list(slots.shape)}")
    least = rows if slots is None else 1
    if keys.shape != values.shape or keys.shape[1] != kv_heads or keys.shape[0] < least:
        raise RopeError(f"cache {list(keys.shape)} is not [>= {least}, {kv_heads}, C, {d}]")
    if (norms[0] is None) != (norms[1] is None) or any(
        w is not None and w.shape != (d,) for w in norms
    ):
        raise RopeError(f"q_norm and k_norm must both be [{d}] weights, or both None")
    return d


def rope_cache_triton(
    qkv, cos, sin, filled, keys, values, q_heads: int, kv_heads: int, slots=None,
    q_norm=None, k_norm=None, eps: float = 0.0,
):  # fmt: skip
    """Rotated queries `[B, Hq, d]`; the rotated keys and the values written into column
    `min(filled[b], C - 1)` of slot b (`slots[b]` where given) of `keys`, `values`
    (`[slots, Hkv, C, d]`). With `q_norm`, `k_norm` (`[d]` weights), each q and k head
    is RMS-normalized (`eps`) before its rotation."""
    d = _check(qkv, cos, sin, filled, keys, values, q_heads, kv_heads, slots, (q_norm, k_norm))
    rows = qkv.shape[0]
    q = torch.empty(rows, q_heads, d, dtype=qkv.dtype, device=qkv.device)
    if rows:
        _rope_cache_kernel[(rows, q_heads + kv_heads)](
            qkv, cos, sin, filled, filled if slots is None else slots, q, keys, values,
            qkv if q_norm is None else q_norm, qkv if k_norm is None else k_norm, eps,
            qkv.stride(0), cos.stride(0), q.stride(0), q.stride(1),
            keys.stride(0), keys.stride(1), keys.stride(2), keys.shape[2],
            Q_HEADS=q_heads, KV_HEADS=kv_heads, D=d, BLOCK=triton.next_power_of_2(d),
            HAS_SLOTS=slots is not None, QK_NORM=q_norm is not None, num_warps=1,
            **dependent_launch(qkv),
        )  # fmt: skip
    return q


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm over the last dim."""
    wide = x.float()
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def reference(
    qkv, cos, sin, filled, keys, values, q_heads: int, kv_heads: int, slots=None,
    q_norm=None, k_norm=None, eps: float = 0.0,
):  # fmt: skip
    """HF's q/k norms and rotation, op by op, and the cache write as an indexed copy."""
    d = _check(qkv, cos, sin, filled, keys, values, q_heads, kv_heads, slots, (q_norm, k_norm))
    rows = qkv.shape[0]
    heads = qkv.view(rows, q_heads + 2 * kv_heads, d)
    q, k = heads[:, :q_heads], heads[:, q_heads : q_heads + kv_heads]
    v = heads[:, q_heads + kv_heads :]
    if q_norm is not None:
        q, k = _rms_norm(q, q_norm, eps), _rms_norm(k, k_norm, eps)
    c, s = cos[:, None], sin[:, None]
    q = (q * c) + (_rotate_half(q) * s)
    k = (k * c) + (_rotate_half(k) * s)
    slot = torch.arange(rows, device=qkv.device) if slots is None else slots
    where = (slot[:, None], torch.arange(kv_heads, device=qkv.device)[None])
    column = filled.clamp(max=keys.shape[2] - 1)[:, None]
    keys[(*where, column)] = k
    values[(*where, column)] = v
    return q


def rope_cache(
    qkv, cos, sin, filled, keys, values, q_heads: int, kv_heads: int, slots=None,
    q_norm=None, k_norm=None, eps: float = 0.0,
):  # fmt: skip
    """The kernel on CUDA, the reference elsewhere."""
    run = reference
    if qkv.is_cuda and triton is not None:
        run = rope_cache_triton
    return run(qkv, cos, sin, filled, keys, values, q_heads, kv_heads, slots, q_norm, k_norm, eps)
