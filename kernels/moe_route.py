"""A MoE layer's routing: the router's logits `[T, E]` to what the fused experts
(`omniflow.kernels.fused_moe`) take, each token's top-k experts and their weights and the
(token, expert) entries sorted into each expert's blocks of `block_m` rows, in ONE launch
on CUDA where the sizes fit (`fits`: a decode step's), and the torch ops it is tested against:
`route` (the router's top k) and `align` (the entries into blocks), which are also what
runs beyond those sizes and off CUDA.

Why: at one token a MoE layer's routing was the router's linear, then `route` (softmax,
topk, sum, div, cast: ~5 kernels) and `align` (3 kernels at T = 1, ~14 otherwise), before
its two grouped products: ~8 small kernels a layer, ~380 a step of the thinker's 48
layers, each a few microseconds even replayed from a CUDA graph, against a step whose
weights take ~1.5 ms to read. Here they are one kernel a layer. Its speed is
`benchmarks/fused_moe.py`'s to tell (docs/benchmarks.md, "Kernels").

The kernel: one program owns the whole `[T, E]` tile (T and E padded to powers of two):
1. the softmax in float32 (the row's max, `exp` of the differences, their sum, a correctly
   rounded division: torch's arithmetic; on CUDA `exp` is libdevice's `expf`, the function
   torch's softmax calls, where Triton's `tl.exp` is an approximation);
2. top k: k passes, each taking every row's largest probability, the lowest index among
   equal ones (`tl.max`, then `tl.min` of the indices holding it), recording its choice
   number in a `[T, E]` tile of choices and marking it taken; then the k weights
   renormalised by their float32 sum where `renormalize`, rounded to the logits' dtype, and
   the ids and weights stored;
3. the entries into blocks, from the tile of choices: an expert's count is its column's sum;
   an entry's rank within its expert is the column's running count (`tl.cumsum` over the
   tokens: a token picks an expert at most once, so token order is entry order); an
   expert's first block is the running sum of the blocks before it (`tl.cumsum` over the
   experts). Each entry is stored at its expert's first row plus its rank. Then, a chunk of
   blocks at a time, each block's expert (the count of experts whose blocks end at or
   before it; -1 past the last used block) and the block's padding rows (past the entries
   its expert has left for it): every row of `sorted_ids` is written exactly once, so no
   fill has to be ordered before the entries' stores.
No value goes back to the host; the grid (one program) and every shape follow from the
operands' shapes, so a captured decode step replays it.

The bound (`fits`): the padded `[T, E]` tile at most 8192 elements (T <= 64 at E = 128, a
thinker or talker decode step at batch <= 64). The program holds that tile several times
over in registers (the logits and probabilities, the choices, their ranks and positions),
with a warp for each 512 elements (4 to 16): compiled for sm_90 (Triton 3.9), 32 tokens take
174 registers a thread at 8 warps and spill nothing, 64 take 128 at 16 warps (the most a
thread gets there) and spill 32 bytes; past it the spills grow, and one program on one SM
runs k passes over the tile, a time growing with T while the torch ops' at decode sizes
is their launches'. Past it (prefill, big batches) `route` and `align` run, whose launches
the tokens amortise.

Numerics: ids and weights are `route`'s (softmax in float32, top k, renormalised in float32
where `renormalize`, rounded to the logits' dtype). What can differ is the order of its two
float32 sums (the softmax's and the renormalisation's) and `exp`; the kernel adds both in
the orders torch's CUDA kernels do at these sizes (`_softmax_sum`: PersistentSoftmax's warp
softmax, up to 1024 experts; `_weights_sum`: ATen's sum over a last dimension of k), calls
libdevice's `expf` without flushing subnormals (as nvcc compiles torch's `std::exp`),
divides correctly rounded and contracts nothing into an FMA (tests/kernels/test_moe_route.py
checks on the CPU that it adds in those orders). Measured on an H200 (torch 2.11,
2026-12-05): the softmax's sum is torch's everywhere, the weights torch's bits up to 2
tokens; from 7 tokens on ATen sums the k in another order, and about a quarter of the
renormalised float32 weights lie 1 or 2 units from torch's (bf16 weights: its bits).
Whatever torch's orders, a weight is
within `(2 E + 2 k + 4)` float32 rounding units (u = 2^-24) of torch's (each sum of n
positive terms is within (n - 1) u of the exact one whatever the order, `exp` within a
unit on each side, the divisions correctly rounded): `weight_tolerance`; rounded to bf16
(or fp16) that is far below a step, so a weight is torch's or one step from it. Under
Triton's interpreter (the CPU tests) `exp` is numpy's and the float32-to-bf16 cast
truncates, so there the bound is what holds. An id can differ only where two of a row's
probabilities lie within that bound of each other without being equal. Ties (equal
logits: equal probabilities on both sides) go to the lower index first; torch.topk's order
among equal values is unspecified on the CPU and on CUDA (pytorch/pytorch#127196 shows
CUDA's putting the higher index first), so `route` may take another of the tied experts:
the same probabilities, another id.
`sorted_ids`/`expert_ids` are `align`'s on the kernel's ids (int64, as `align`'s).
"""

from __future__ import annotations

import torch

from omniflow.errors import OmniflowError
from omniflow.kernels.timing import cuda_median_ms
from omniflow.kernels.triton_guard import dependent_launch, gdc_enter, jit, libdevice, tl, triton

# The largest padded [T, E] tile one program routes (see the module docstring).
MAX_TILE = 8192
# A pass over the blocks takes this many (block, expert) pairs and block rows at most.
BLOCKS_TILE = 4096


class RouteError(OmniflowError):
    """Router logits that are not `[T, E]`, or a top k outside 1..E."""


@jit
def _moe_route_kernel(
    logits_ptr, ids_ptr, weights_ptr, sorted_ptr, expert_ids_ptr,
    tokens, experts, row_stride, col_stride, blocks,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr,
    SOFTMAX_LANES: tl.constexpr, SOFTMAX_ROUNDS: tl.constexpr,
    SUM_LANES: tl.constexpr, SUM_ROUNDS: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(GDC)
    rows = tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_in = rows < tokens
    inside = row_in[:, None] & (cols < experts)[None, :]
    offsets = rows[:, None] * row_stride + cols[None, :] * col_stride
    x = tl.load(logits_ptr + offsets, mask=inside, other=float("-inf")).to(tl.float32)
    # Softmax in float32; padding rows (all -inf) take a max of 0 rather than a NaN.
    top = tl.where(row_in, tl.max(x, axis=1), 0.0)
    shifted = x - top[:, None]
    scores = libdevice.exp(shifted) if LIBDEVICE_EXP else tl.exp(shifted)
    total = _softmax_sum(scores, BLOCK_T, BLOCK_E, SOFTMAX_LANES, SOFTMAX_ROUNDS)
    total = tl.where(row_in, total, 1.0)
    # Below every probability (>= 0), so padding is never taken; taken ones go lower still.
    probs = tl.where(inside, tl.math.div_rn(scores, total[:, None]), -1.0)

    # Top k: each pass takes every row's largest, the lowest index among equals.
    choice = tl.full((BLOCK_T, BLOCK_E), -1, tl.int32)  # which of the row's k, or -1
    slots = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    weights = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        pick = tl.min(tl.where(probs == best[:, None], cols[None, :], BLOCK_E), axis=1)
        taken = cols[None, :] == pick[:, None]
        choice = tl.where(taken, j, choice)
        probs = tl.where(taken, -2.0, probs)
        ids = tl.where(slots[None, :] == j, pick[:, None], ids)
        weights = tl.where(slots[None, :] == j, best[:, None], weights)
    if RENORMALIZE:
        chosen_sum = _weights_sum(weights, BLOCK_T, BLOCK_K, SUM_LANES, SUM_ROUNDS)
        weights = tl.math.div_rn(weights, chosen_sum[:, None])
    out = rows[:, None] * TOP_K + slots[None, :]
    kept = row_in[:, None] & (slots < TOP_K)[None, :]
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=kept)
    tl.store(weights_ptr + out, weights.to(weights_ptr.dtype.element_ty), mask=kept)

    # The entries into blocks: entry t k + j is token t's choice j.
    chosen = (choice >= 0) & row_in[:, None]
    picks = chosen.to(tl.int32)
    counts = tl.sum(picks, axis=0)  # each expert's entries
    rank = tl.cumsum(picks, axis=0) - 1  # within the expert's, in token (= entry) order
    expert_blocks = (counts + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(expert_blocks, axis=0)  # one past each expert's last block
    starts = ends - expert_blocks
    used = tl.sum(expert_blocks, axis=0)
    entries = tokens * TOP_K
    position = starts[None, :] * BLOCK_M + rank
    entry = rows[:, None] * TOP_K + choice
    tl.store(sorted_ptr + position, entry.to(tl.int64), mask=chosen)
    # Each block's expert, and its rows past its expert's entries padded with `entries`.
    block_rows = tl.arange(0, BLOCK_M)
    for first in range(0, blocks, BLOCK_B):
        block = first + tl.arange(0, BLOCK_B)
        owner = tl.sum((ends[None, :] <= block[:, None]).to(tl.int32), axis=1)
        owns = cols[None, :] == owner[:, None]  # none past the last used block
        owner_count = tl.sum(tl.where(owns, counts[None, :], 0), axis=1)
        owner_start = tl.sum(tl.where(owns, starts[None, :], 0), axis=1)
        held = tl.minimum(tl.maximum(owner_count - (block - owner_start) * BLOCK_M, 0), BLOCK_M)
        block_in = block < blocks
        expert = tl.where(block < used, owner, -1)
        tl.store(expert_ids_ptr + block, expert.to(tl.int64), mask=block_in)
        pad = (block_rows[None, :] >= held[:, None]) & block_in[:, None]
        padding = tl.full((BLOCK_B, BLOCK_M), entries, tl.int64)
        tl.store(sorted_ptr + block[:, None] * BLOCK_M + block_rows[None, :], padding, mask=pad)


@jit
def _softmax_sum(
    scores, ROWS: tl.constexpr, COLS: tl.constexpr, LANES: tl.constexpr, ROUNDS: tl.constexpr
):
    """Each row's sum in the order of torch's CUDA warp softmax (PersistentSoftmax.cuh, up to
    1024 columns): lane l of `LANES` adds columns l, l + LANES, ... in turn from 0, then the
    lanes pairwise, the upper half onto the lower each round (`__shfl_xor_sync` from the
    top offset down). A sum over an axis of two is one add, whichever way round."""
    steps: tl.constexpr = COLS // LANES
    by_step = tl.reshape(scores, (ROWS, steps, LANES))
    step = tl.arange(0, steps)[None, :, None]
    lanes = tl.zeros((ROWS, LANES), dtype=tl.float32)
    for i in tl.static_range(steps):  # a sum of one value and zeros: that value
        lanes += tl.sum(tl.where(step == i, by_step, 0.0), axis=1)
    for r in tl.static_range(ROUNDS):
        lanes = tl.sum(tl.reshape(lanes, (ROWS, 2, LANES >> (r + 1))), axis=1)
    return tl.reshape(lanes, (ROWS,))


@jit
def _weights_sum(
    weights, ROWS: tl.constexpr, COLS: tl.constexpr, LANES: tl.constexpr, ROUNDS: tl.constexpr
):
    """Each row's sum of its k weights in the order of ATen's CUDA sum over a last dimension
    of k (Reduce.cuh at these sizes: `LANES`, the largest power of two <= k, threads, lane t
    adding columns t and t + LANES; then lanes pairwise, neighbours first: `shfl_down` by
    1, 2, 4, ...). Columns past k are zeros."""
    # Two columns to a lane where k is not a power of two, else one (a sum of one: itself).
    lanes = tl.sum(tl.reshape(weights, (ROWS, COLS // LANES, LANES)), axis=1)
    for r in tl.static_range(ROUNDS):
        lanes = tl.sum(tl.reshape(lanes, (ROWS, LANES >> (r + 1), 2)), axis=2)
    return tl.reshape(lanes, (ROWS,))


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k expert ids [T, k], their weights [T, k]): transformers' Qwen3-Omni router on
    its logits `[T, E]`: softmax in float32, top k, renormalised to sum 1 in float32 when
    `renormalize`, the weights rounded to the logits' dtype."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(router_logits.dtype)


def most_blocks(entries: int, num_experts: int, block_m: int) -> int:
    """Blocks of `block_m` rows that `entries` entries padded per expert can fill: each used
    expert pads at most `block_m - 1` rows, and at most min(E, entries) experts are used. A
    function of the shapes only, so the kernels' grid needs no value from the device."""
    return (entries + min(num_experts, entries) * (block_m - 1)) // block_m


def block_m_for(entries: int, num_experts: int) -> int:
    """Rows a block: the entries an expert gets on average, as a power of two in [16, 64]
    (16, the smallest tile side of Triton's tensor-core product, up to 16 tokens an expert:
    a thinker decode step of up to 256 tokens)."""
    average = -(-entries // num_experts)
    return max(16, min(64, 1 << max(0, average - 1).bit_length()))


def align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, expert) entries sorted by expert, each expert's run padded to `block_m`.

    `topk_ids` `[T, k]`: entry `e` is token `e // k`'s choice `e % k`. Returns
    `sorted_ids` `[most_blocks * block_m]`: the entries, expert by expert (in entry order
    within one), each expert's run starting a block and padded with `T * k`; and
    `expert_ids` `[most_blocks]`: each block's expert, -1 past the last used block. Both on
    the ids' device, from torch ops whose count and shapes depend only on the shapes (no
    host sync, no loop over experts): fourteen (a sort, a search, a cumsum, two scatters
    and the arithmetic between). One token (a decode step at batch 1) takes three: its k
    experts are distinct, so each is one entry and one block."""
    flat = topk_ids.reshape(-1)
    entries = flat.numel()
    blocks = most_blocks(entries, num_experts, block_m)
    experts, order = torch.sort(flat, stable=True)
    if topk_ids.shape[0] == 1:
        sorted_ids = torch.full(
            (entries * block_m,), entries, dtype=order.dtype, device=flat.device
        )
        sorted_ids[::block_m] = order
        return sorted_ids, experts
    # Each entry's rank among its expert's: its sorted position less its expert's first.
    rank = torch.arange(entries, device=flat.device) - torch.searchsorted(experts, experts)
    within = rank % block_m
    block = torch.cumsum(within == 0, 0) - 1  # a block starts at each expert and every block_m
    sorted_ids = torch.full((blocks * block_m,), entries, dtype=order.dtype, device=flat.device)
    sorted_ids.scatter_(0, block * block_m + within, order)
    expert_ids = torch.full((blocks,), -1, dtype=experts.dtype, device=flat.device)
    expert_ids.scatter_(0, block, experts)  # each block's entries all write its one expert
    return sorted_ids, expert_ids


def _check(router_logits: torch.Tensor, top_k: int) -> None:
    if router_logits.dim() != 2 or not 1 <= top_k <= router_logits.shape[1]:
        raise RouteError(
            f"router logits must be [T, E] and top_k in 1..E: {list(router_logits.shape)},"
            f" top_k {top_k}"
        )


def fits(tokens: int, num_experts: int, block_m: int) -> bool:
    """Whether one program routes `tokens` tokens over `num_experts` experts (MAX_TILE) into
    blocks of `block_m` rows (a power of two, as the experts' kernels take)."""
    tile = triton.next_power_of_2(tokens) * triton.next_power_of_2(num_experts)
    return tile <= MAX_TILE and block_m & (block_m - 1) == 0


def launch_meta(
    tokens: int, experts: int, top_k: int, renormalize: bool, block_m: int, on_cuda: bool
) -> tuple[dict, dict]:
    """The kernel's compile-time arguments and its compile options for these sizes (a warp
    for each 512 elements of the padded [T, E] tile, 4 to 16)."""
    block_t, block_e = triton.next_power_of_2(tokens), triton.next_power_of_2(experts)
    block_k = triton.next_power_of_2(top_k)
    softmax_lanes = min(block_e, 32)
    sum_lanes = block_k if block_k == top_k else block_k // 2
    constexprs = {
        "TOP_K": top_k,
        "RENORMALIZE": renormalize,
        "LIBDEVICE_EXP": on_cuda,
        "BLOCK_T": block_t,
        "BLOCK_E": block_e,
        "BLOCK_K": block_k,
        "BLOCK_M": block_m,
        "BLOCK_B": max(1, BLOCKS_TILE // max(block_e, block_m)),
        "SOFTMAX_LANES": softmax_lanes,
        "SOFTMAX_ROUNDS": softmax_lanes.bit_length() - 1,
        "SUM_LANES": sum_lanes,
        "SUM_ROUNDS": sum_lanes.bit_length() - 1,
    }
    options = {
        "num_warps": max(4, min(16, block_t * block_e // 512)),
        "enable_fp_fusion": False,  # torch's roundings: nothing contracted into an FMA
        "enable_reflect_ftz": False,  # libdevice's expf as nvcc compiles torch's: no flush
    }
    return constexprs, options


def moe_route_triton(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [T, k], weights [T, k], sorted_ids, expert_ids) in one launch: `route`'s and
    `align`'s (see the module docstring for where they may differ). Up to `fits` sizes;
    `block_m` a power of two."""
    _check(router_logits, top_k)
    tokens, experts = router_logits.shape
    if not fits(tokens, experts, block_m):
        raise RouteError(
            f"{tokens} tokens over {experts} experts with {block_m}-row blocks: past one"
            f" program's tile ({MAX_TILE} elements, powers of two): use route and align"
        )
    device = router_logits.device
    entries = tokens * top_k
    blocks = most_blocks(entries, experts, block_m)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=device)
    weights = torch.empty(tokens, top_k, dtype=router_logits.dtype, device=device)
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int64, device=device)
    expert_ids = torch.empty(blocks, dtype=torch.int64, device=device)
    if tokens:
        constexprs, options = launch_meta(
            tokens, experts, top_k, renormalize, block_m, router_logits.is_cuda
        )
        _moe_route_kernel[(1,)](
            router_logits, ids, weights, sorted_ids, expert_ids,
            tokens, experts, router_logits.stride(0), router_logits.stride(1), blocks,
            **constexprs, **options, **dependent_launch(router_logits),
        )  # fmt: skip
    return ids, weights, sorted_ids, expert_ids


def reference(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_route_triton`'s four results as torch computes them: `route`, then `align`."""
    _check(router_logits, top_k)
    ids, weights = route(router_logits, top_k, renormalize)
    return (ids, weights, *align(ids, router_logits.shape[1], block_m))


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel on CUDA where the sizes fit, the reference elsewhere (on the CPU too under
    Triton's interpreter: its float32 sums and `exp` are not torch's CPU ones, and the
    static decode's tests there compare whole decodes with torch's)."""
    _check(router_logits, top_k)
    tokens, experts = router_logits.shape
    if router_logits.is_cuda and triton is not None and fits(tokens, experts, block_m):
        return moe_route_triton(router_logits, top_k, renormalize, block_m)
    return reference(router_logits, top_k, renormalize, block_m)


def weight_tolerance(dtype: torch.dtype, num_experts: int, top_k: int) -> float:
    """Relative distance a kernel weight may lie from `route`'s (the module docstring's
    bound): float32 the rounding bound of the sums; a narrower dtype, one of its steps."""
    if dtype == torch.float32:
        return (2 * num_experts + 2 * top_k + 4) * 2.0**-24
    return torch.finfo(dtype).eps  # one step relative to the value


def benchmark(tokens: int = 1, experts: int = 128, top_k: int = 8, iters: int = 200) -> dict:
    """Median milliseconds of the kernel and of `route` + `align` on CUDA, bf16 logits, the
    thinker's router (128 experts, 8 a token, renormalised)."""
    logits = torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16)
    block_m = block_m_for(tokens * top_k, experts)
    return {
        name: cuda_median_ms(lambda fn=fn: fn(logits, top_k, True, block_m), iters)
        for name, fn in (("triton", moe_route_triton), ("torch", reference))
    }


if __name__ == "__main__":
    for tokens in (1, 8, 32, 64):
        print(f"T={tokens}", benchmark(tokens))
