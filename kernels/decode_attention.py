"""A decode step's attention over a static KV cache, each row over its own filled columns,
whose count the kernel reads on the device: `[B, Hkv, G, d]` queries (the G query heads of
each key/value head) against a layer's cache `[slots, Hkv, C, d]`, row b over columns
0..filled[b] of slot b (or of slot `slots[b]`: several rows of one slot at different
columns, e.g. a sequence's positions whose keys a step wrote together). A Triton kernel
pair on CUDA (flash decoding: the columns split into chunks run in parallel, each with its
own running softmax, then one pass combines them; a row of one chunk, as a short cache's
always is, writes its output at once, with no combine), and the torch reference
(`reference`: SDPA over the first `length` columns with the mask the static step uses) it
is tested against.

Why: torch's attention takes the columns it reads as a shape, so the static decode step
attends over a length bucket T (a power of two past the longest row) and needs a CUDA graph
per (batch, T) pair: 6 lengths x 11 batch buckets for a 4,096-column cache at batch 64. Here
the columns a row reads are data, so one graph per batch bucket serves every length, and a
row reads only its own columns (a chunk past a row's last column exits at once).

Numerics: scores and the running softmax in float32, the probabilities rounded to the
cache's dtype for their product with the values (as flash attention does), the output
rounded once; float32 operands (and every operand off CUDA: Triton's interpreter cannot
multiply bf16 matrices) in float32 products. Against the reference on bf16 within a few
steps of the dtype.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from omniflow.errors import OmniflowError
from omniflow.kernels.softmax_tile import online_softmax_tile
from omniflow.kernels.triton_guard import dependent_launch, gdc_enter, jit, on_triton, tl, triton

# Columns a program reads per tile (fewer where the whole cache is fewer: a code predictor's
# 16), and the most chunks a row's columns are split into.
BLOCK_N = 64
MAX_SPLITS = 32
# A chunk is at least this many columns: shorter ones would only add partials to combine.
MIN_CHUNK = 256
# Programs per SM the chunks aim for: beyond it (large batches) a split only adds a partial
# to write and combine (at batch 64, 16 chunks a row made short rows' attention 1.9x
# slower than SDPA's on an H100: benchmarks/decode_attention.py).
PROGRAMS_PER_SM = 4


class DecodeAttentionError(OmniflowError):
    """Queries, cache or lengths of shapes that do not fit together."""


@jit
def _chunk_kernel(
    q_ptr, k_ptr, v_ptr, filled_ptr, slots_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, scale,
    columns, chunk, q_sb, q_sh, q_sg, k_sb, k_sh, k_sc, v_sb, v_sh, v_sc, o_sb, o_sh, o_sg,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, IN_FLOAT32: tl.constexpr, WHOLE: tl.constexpr,
    HAS_SLOTS: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """One (row, key/value head, chunk): its queries against the chunk's columns up to the
    row's last, an online softmax; writes the chunk's running max, sum and weighted values
    (max -inf, sum 0 where the chunk starts past the row's last column), or where the chunk
    is the row's whole (WHOLE: one split) its output."""
    gdc_enter(GDC)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    last = tl.minimum(tl.load(filled_ptr + b), columns - 1)
    start = split * chunk
    end = tl.minimum(start + chunk, last + 1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    q_mask = (g[:, None] < G) & (d[None, :] < D)
    q = tl.load(
        q_ptr + b * q_sb + h * q_sh + g[:, None] * q_sg + d[None, :], mask=q_mask, other=0.0
    )
    if IN_FLOAT32:
        q = q.to(tl.float32)
    top = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    slot = tl.load(slots_ptr + b).to(tl.int64) if HAS_SLOTS else b
    keys = k_ptr + slot * k_sb + h * k_sh
    values = v_ptr + slot * v_sb + h * v_sh
    for first in range(start, end, BLOCK_N):
        n = first + tl.arange(0, BLOCK_N)
        inside = n < end
        k = tl.load(
            keys + n[None, :] * k_sc + d[:, None],
            mask=inside[None, :] & (d[:, None] < D),
            other=0.0,
        )
        if IN_FLOAT32:
            k = k.to(tl.float32)
        scores = tl.dot(q, k, input_precision="ieee" if IN_FLOAT32 else "tf32") * scale
        scores = tl.where(inside[None, :], scores, float("-inf"))
        v = tl.load(
            values + n[:, None] * v_sc + d[None, :],
            mask=inside[:, None] & (d[None, :] < D),
            other=0.0,
        )
        if IN_FLOAT32:
            v = v.to(tl.float32)
        top, total, acc = online_softmax_tile(top, total, acc, scores, v, IN_FLOAT32)
    if WHOLE:  # (every row reads its column 0 at least: total > 0)
        out = acc / total[:, None]
        where = out_ptr + b * o_sb + h * o_sh + g[:, None] * o_sg + d[None, :]
        tl.store(where, out.to(out_ptr.dtype.element_ty), mask=q_mask)
        return
    # The chunk's partials, its G rows (an empty chunk's max -inf and sum 0, and no values:
    # the combine weighs it 0 and reads none).
    at = ((b * tl.num_programs(1) + h) * tl.num_programs(2) + split) * G + g
    tl.store(m_ptr + at, top, mask=g < G)
    tl.store(l_ptr + at, total, mask=g < G)
    rows = tl.where(start < end, G, 0)
    tl.store(
        acc_ptr + at[:, None] * D + d[None, :], acc, mask=(g[:, None] < rows) & (d[None, :] < D)
    )


@jit
def _combine_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, o_sb, o_sh, o_sg,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """One (row, key/value head): its chunks' partial softmaxes combined into its output."""
    gdc_enter(GDC)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    base = (b * tl.num_programs(1) + h) * SPLITS
    mask = (g[:, None] < G) & (d[None, :] < D)
    top = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for split in range(SPLITS):
        top = tl.maximum(top, tl.load(m_ptr + (base + split) * G + g, mask=g < G, other=0.0))
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for split in range(SPLITS):
        at = (base + split) * G + g
        chunk_top = tl.load(m_ptr + at, mask=g < G, other=float("-inf"))
        weight = tl.exp(chunk_top - top)
        total += weight * tl.load(l_ptr + at, mask=g < G, other=0.0)
        some = mask & (chunk_top > float("-inf"))[:, None]  # (an empty chunk wrote no values)
        acc += weight[:, None] * tl.load(
            acc_ptr + at[:, None] * D + d[None, :], mask=some, other=0.0
        )
    out = acc / total[:, None]
    where = out_ptr + b * o_sb + h * o_sh + g[:, None] * o_sg + d[None, :]
    tl.store(where, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    filled: torch.Tensor,
    slots: torch.Tensor | None,
) -> None:
    if q.dim() != 4 or keys.dim() != 4 or keys.shape != values.shape:
        raise DecodeAttentionError(
            f"q must be [B, Hkv, G, d] and keys, values [slots, Hkv, C, d], not "
            f"{list(q.shape)}, {list(keys.shape)}, {list(values.shape)}"
        )
    b, heads, _, d = q.shape
    least = b if slots is None else 1  # (slots' values are on the device: not read here)
    if keys.shape[0] < least or keys.shape[1] != heads or keys.shape[3] != d:
        raise DecodeAttentionError(
            f"a cache {list(keys.shape)} does not hold queries {list(q.shape)}: it needs "
            f">= {least} slots of {heads} heads of {d}"
        )
    if filled.shape != (b,):
        raise DecodeAttentionError(f"filled must be [{b}], not {list(filled.shape)}")
    if slots is not None and (slots.shape != (b,) or slots.is_floating_point()):
        raise DecodeAttentionError(f"slots must be [{b}] integers, not {list(slots.shape)}")
    if q.stride(3) != 1 or keys.stride(3) != 1 or values.stride(3) != 1:
        raise DecodeAttentionError("q, keys and values need contiguous head dims")


def splits_for(columns: int, programs: int, sms: int) -> int:
    """The chunks a row's `columns` are split into, where `programs` (rows x heads) run on a
    GPU of `sms` SMs: enough to give each SM PROGRAMS_PER_SM programs, in chunks of at least
    MIN_CHUNK columns, at most MAX_SPLITS (fixed by the shapes, never the rows' lengths, so a
    captured step's grid is the one it replays)."""
    wanted = math.ceil(PROGRAMS_PER_SM * sms / max(programs, 1))
    return max(1, min(MAX_SPLITS, math.ceil(columns / MIN_CHUNK), wanted))


@functools.cache
def _sms(device: torch.device) -> int:
    """The SMs of a CUDA device; a GPU's worth elsewhere (Triton's interpreter)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_attention_triton(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    filled: torch.Tensor,
    scale: float,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[B, Hkv, G, d]`: each row's queries over its columns 0..filled[b] (clamped to the
    cache) of its slot b (`slots[b]` where given). Device work only: no shape depends on
    `filled` or `slots`."""
    _check(q, keys, values, filled, slots)
    b, heads, group, d = q.shape
    columns = keys.shape[2]
    splits = splits_for(columns, b * heads, _sms(q.device))
    block_n = max(16, min(BLOCK_N, triton.next_power_of_2(columns)))
    chunk = math.ceil(math.ceil(columns / splits) / block_n) * block_n
    block_g, block_d = max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(d))
    out = torch.empty_like(q)
    if b == 0:
        return out
    partial = (b, heads, splits, group) if splits > 1 else (0,)  # (one split: no partials)
    top = torch.empty(partial, dtype=torch.float32, device=q.device)
    total = torch.empty_like(top)
    acc = torch.empty(*partial, d, dtype=torch.float32, device=q.device)
    _chunk_kernel[(b, heads, splits)](
        q, keys, values, filled, filled if slots is None else slots, top, total, acc, out,
        scale, columns, chunk,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        G=group, D=d, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
        IN_FLOAT32=q.dtype == torch.float32 or not q.is_cuda, WHOLE=splits == 1,
        HAS_SLOTS=slots is not None, **dependent_launch(q),
    )  # fmt: skip
    if splits == 1:
        return out
    _combine_kernel[(b, heads)](
        top, total, acc, out, out.stride(0), out.stride(1), out.stride(2),
        G=group, D=d, BLOCK_G=block_g, BLOCK_D=block_d, SPLITS=splits, **dependent_launch(q),
    )  # fmt: skip
    return out


def reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    filled: torch.Tensor,
    scale: float,
    length: int | None = None,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """The static step's attention: SDPA over the first `length` columns (default: every
    one) of row b's slot (b, or `slots[b]`), column j visible to row b where j <= filled[b]."""
    _check(q, keys, values, filled, slots)
    b, columns = q.shape[0], keys.shape[2]
    length = columns if length is None else length
    visible = torch.arange(length, device=q.device)[None] <= filled[:, None]
    mask = torch.where(visible, 0.0, -math.inf).to(q.dtype)[:, None, None]
    rows = slice(0, b) if slots is None else slots
    keys, values = keys[rows, :, :length], values[rows, :, :length]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


def decode_attention(q, keys, values, filled, scale: float, slots=None) -> torch.Tensor:
    """The kernels on CUDA (and under Triton's interpreter), the reference elsewhere."""
    if on_triton(q):
        return decode_attention_triton(q, keys, values, filled, scale, slots)
    return reference(q, keys, values, filled, scale, slots=slots)
