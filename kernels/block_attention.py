"""Block-local attention: each position attends the positions whose block is at most `back`
blocks before its own and at most `ahead` after, blocks given per position as data —
`[R, T, H, d]` queries, keys and values (strided views of a fused q/k/v product) to
`[R, T, H, d]` outputs, which the output product reads as `[R * T, H * d]` without a copy. A
Triton kernel on CUDA (flash attention over only the key tiles a query tile can see), and
the torch reference (`reference`: SDPA over every position with the additive block mask)
it is tested against.

Why: token2wav's DiT attends within 24-frame blocks — 19 of its 22 layers its own block
only, the other three one block back or ahead — and SDPA, given that as a mask over the
whole window, computes every (query, key) pair of a 480-frame window: 20x the pairs the
own-block layers use, plus a read of the mask per head. Here a query tile reads only the key
tiles within `block_size * (back + 1)` positions before it and `block_size * (ahead + 1)`
after: where blocks run at most `block_size` positions (a window's blocks: position //
block_size), every visible key lies there. Positions outside every real block (padding)
carry a block of their own far from all others; they see only such positions in that
range, so their outputs differ from the reference's (which sees all of them), while no
real position sees them: the reference's outputs at real positions are the kernel's.

Numerics: scores and the running softmax in float32, the probabilities rounded to the
values' dtype for their product (as flash attention does), the output rounded once;
float32 operands (and every operand off CUDA: Triton's interpreter cannot multiply bf16
matrices) in float32 products.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from omniflow.errors import OmniflowError
from omniflow.kernels.softmax_tile import online_softmax_tile
from omniflow.kernels.timing import cuda_median_ms
from omniflow.kernels.triton_guard import jit, on_triton, tl, triton

# Query positions a program holds, and key positions per tile it reads.
BLOCK_M = 64
BLOCK_N = 64


class BlockAttentionError(OmniflowError):
    """Queries, keys, values or blocks of shapes that do not fit together."""


@jit
def _block_attention_kernel(
    q_ptr, k_ptr, v_ptr, block_ptr, out_ptr, scale, length, heads,
    q_sr, q_st, q_sh, k_sr, k_st, k_sh, v_sr, v_st, v_sh, o_sr, o_st, o_sh, b_sr,
    BACK: tl.constexpr, AHEAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KEY_TILES: tl.constexpr, IN_FLOAT32: tl.constexpr,
):  # fmt: skip
    """One (query tile, row, head): the tile's queries over the key tiles they can see,
    an online softmax."""
    tile = tl.program_id(0)
    r = (tl.program_id(1) // heads).to(tl.int64)
    h = (tl.program_id(1) % heads).to(tl.int64)
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_in = m < length
    q = tl.load(
        q_ptr + r * q_sr + h * q_sh + m[:, None] * q_st + d[None, :],
        mask=m_in[:, None] & (d[None, :] < D),
        other=0.0,
    )
    if IN_FLOAT32:
        q = q.to(tl.float32)
    q_block = tl.load(block_ptr + r * b_sr + m, mask=m_in, other=0)
    # The keys the tile's queries can see: a block runs at most BLOCK_SIZE positions, so
    # they lie in KEY_TILES tiles from `first` (a fixed count: the loop is static).
    first = tile * BLOCK_M - BLOCK_SIZE * (BACK + 1) + 1
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for key_tile in range(KEY_TILES):
        n = first + key_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_in = (n >= 0) & (n < length)
        k = tl.load(
            k_ptr + r * k_sr + h * k_sh + n[None, :] * k_st + d[:, None],
            mask=n_in[None, :] & (d[:, None] < D),
            other=0.0,
        )
        if IN_FLOAT32:
            k = k.to(tl.float32)
        k_block = tl.load(block_ptr + r * b_sr + n, mask=n_in, other=0)
        apart = k_block[None, :] - q_block[:, None]
        seen = n_in[None, :] & (apart >= -BACK) & (apart <= AHEAD)
        scores = tl.dot(q, k, input_precision="ieee" if IN_FLOAT32 else "tf32") * scale
        scores = tl.where(seen, scores, float("-inf"))
        v = tl.load(
            v_ptr + r * v_sr + h * v_sh + n[:, None] * v_st + d[None, :],
            mask=n_in[:, None] & (d[None, :] < D),
            other=0.0,
        )
        if IN_FLOAT32:
            v = v.to(tl.float32)
        top, total, acc = online_softmax_tile(top, total, acc, scores, v, IN_FLOAT32)
    out = acc / total[:, None]
    tl.store(
        out_ptr + r * o_sr + h * o_sh + m[:, None] * o_st + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_in[:, None] & (d[None, :] < D),
    )


def _check(q, k, v, blocks):
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise BlockAttentionError(
            f"q, k and v must be [R, T, H, d] alike, not {list(q.shape)}, {list(k.shape)}, "
            f"{list(v.shape)}"
        )
    if blocks.shape != q.shape[:2]:
        raise BlockAttentionError(
            f"blocks must be [R, T] = {list(q.shape[:2])}, not {list(blocks.shape)}"
        )
    if q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1:
        raise BlockAttentionError("q, k and v need contiguous head dims")


def block_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: torch.Tensor,
    back: int,
    ahead: int,
    block_size: int,
) -> torch.Tensor:
    """`[R, T, H, d]` (contiguous): each position over the positions of blocks `back`
    before its own to `ahead` after (`blocks` `[R, T]` int32, each block at most
    `block_size` consecutive positions). Device work only."""
    _check(q, k, v, blocks)
    rows, length, heads, d = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    blocks = blocks.to(torch.int32).contiguous()
    if rows == 0 or length == 0:
        return out
    _block_attention_kernel[(triton.cdiv(length, BLOCK_M), rows * heads)](
        q, k, v, blocks, out, 1 / math.sqrt(d), length, heads,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        blocks.stride(0),
        BACK=back, AHEAD=ahead, BLOCK_SIZE=block_size, D=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        KEY_TILES=triton.cdiv(BLOCK_M + block_size * (back + ahead + 2) - 2, BLOCK_N),
        IN_FLOAT32=q.dtype == torch.float32 or not q.is_cuda,
    )  # fmt: skip
    return out


def block_mask(blocks: torch.Tensor, back: int, ahead: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask `[R, 1, T, T]` (0 where query i sees key j, -inf elsewhere) the
    kernel's rule gives, as token2wav's DiT layers make theirs from block distances."""
    apart = (blocks[:, None, :] - blocks[:, :, None])[:, None]
    seen = (apart >= -back) & (apart <= ahead)
    return torch.zeros(seen.shape, dtype=dtype, device=blocks.device).masked_fill(~seen, -math.inf)


def reference(q, k, v, blocks, back: int, ahead: int, block_size: int) -> torch.Tensor:
    """SDPA over every position with `block_mask`: `[R, T, H, d]`."""
    _check(q, k, v, blocks)
    mask = block_mask(blocks, back, ahead, q.dtype)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
    )
    return out.transpose(1, 2).contiguous()


def block_attention(q, k, v, blocks, back: int, ahead: int, block_size: int) -> torch.Tensor:
    """The kernel on CUDA (and under Triton's interpreter), the reference elsewhere."""
    if on_triton(q):
        return block_attention_triton(q, k, v, blocks, back, ahead, block_size)
    return reference(q, k, v, blocks, back, ahead, block_size)


def benchmark(rows: int = 20, length: int = 480, heads: int = 16, iters: int = 50) -> dict:
    """Median milliseconds of the kernel and the reference on CUDA at token2wav's DiT shapes
    (default: ten 240-code windows with guidance, 20 rows of 480 mel frames, 16 heads of
    64), bf16, for each reach its layers use; and the largest difference between them."""
    qkv = torch.randn(rows, length, 3, heads, 64, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    blocks = (torch.arange(length, device="cuda") // 24)[None].expand(rows, -1).contiguous()
    found = {}
    for back, ahead in ((0, 0), (1, 0), (0, 1)):
        inputs = (q, k, v, blocks, back, ahead, 24)
        for name, fn in (("triton", block_attention_triton), ("sdpa", reference)):
            found[back, ahead, name] = cuda_median_ms(lambda fn=fn, i=inputs: fn(*i), iters)
        diff = block_attention_triton(*inputs).float() - reference(*inputs).float()
        found[back, ahead, "max diff"] = diff.abs().max().item()
    return found


if __name__ == "__main__":
    for (back, ahead, name), value in benchmark().items():
        print(f"back {back} ahead {ahead} {name}: {value:.3g}" + ("" if "diff" in name else " ms"))
