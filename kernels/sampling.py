"""Batched token sampling for autoregressive decode: one Triton kernel over `[B, V]` logits,
and the sort-based torch reference it is tested against.

Every row carries its own parameters, as device tensors: temperature (0 = greedy),
top-k (<= 0 or >= V: off), top-p (>= 1: off), repetition penalty over a `[B, V]` boolean
"seen" mask, and a counter-based random draw keyed by (seed, step). The kernel writes only
the sampled ids `[B]`, so a decode step reads back B integers; the parameters, the seen mask
and the logits never leave the device (callers mark new tokens seen on the device, e.g.
`seen.scatter_(1, ids[:, None], True)`).

Semantics are those of `omniflow.backends.transformers_ar._warp` after the backend's
repetition penalty, which follow transformers' logits processors: the penalty divides seen
positive logits and multiplies seen negative ones; then temperature; then top-k keeps every
token at least as large as the k-th largest (ties included); then top-p sorts ascending and
drops each token whose cumulative softmax mass is <= 1 - top_p, except the most likely.
Greedy rows take the first index of the penalized maximum, as `argmax` does.

How the kernel filters without sorting. One program owns one row and loops over it in
blocks of BLOCK.

1. Pass 1 reads the logits and the seen mask once, applies the penalty and temperature
   (correctly rounded divisions, as torch's) and writes the row's scores to a float32
   scratch row; on the way it keeps the maximum and its first index (a greedy row stops
   here, having written nothing), the smallest finite score and how many are finite.
2. Both filters keep every score at or above a threshold, so each is a search for one
   value. Top-k's is the k-th largest score; top-p's is the smallest score whose weight
   from below (`exp(score - max)` summed over the scores top-k kept, up to and including
   it) exceeds `1 - top_p` of the kept weight. A search (`_bisect`) holds `lo`, a score
   known to be kept, and `top`, a score above which the threshold cannot be; both are
   scores of the row. One pass tests the midpoint `mid`: do at least k scores reach it
   (top-k)? is the weight of the kept scores below it at most `1 - top_p` of the total
   (top-p)? If so nothing below `mid` is kept and `lo` moves up to the smallest score >=
   `mid`; if not, `top` moves down to the largest score < `mid`. The interval halves in
   value and snaps to scores that occur, so a search ends exactly, at `lo == top` (top-k
   also as soon as exactly k scores reach `lo`): the threshold is a score of the row, the
   kept set is exact, with no buckets or tolerance.
3. Most passes never touch the whole row. Top-k searches the scratch row only until at
   most BLOCK scores reach `lo`; those scores and their ids are copied, in id order, to a
   candidate list (`_compact`), and the search ends on it, one block per pass. Top-p starts
   on that list (after top-k's threshold), and again narrows to at most BLOCK candidates,
   copies them to a second list, and ends there, carrying the weight of the scores it left
   behind. With top-k on, everything after the copy is one block per pass; with top-p alone
   (the first list is the whole row) a few whole passes remain.
4. The draw: u = `tl.rand(seed, step)`, and the first candidate in id order whose
   cumulative weight over the kept set exceeds u times the kept weight (inverse CDF; the
   loop stops at that candidate). Should rounding leave none (u within float error of 1),
   the row takes its most likely token.

Scratch: 20 bytes a token of each row (the scores and two candidate lists of scores and
ids), allocated per call; 97 MB at B = 32 and V = 152064.

Where the kernel can differ from the reference: a token whose cumulative mass lies within
float rounding (~1e-6 relative) of the top-p boundary, since the two sum in different
orders; and scores tied exactly at the top-p boundary, which the kernel keeps all of while
the sort-based reference keeps those its (unstable) sort puts last. Random float logits
have neither in practice; the tests check the kept sets are equal.

The draw is counter-based (Philox, `tl.rand`), a function of (seed, step) alone: the same
request samples the same tokens whatever else is in the batch, and never matches
`torch.multinomial` on a `torch.Generator`. The reference reproduces Philox with torch
integer ops (`uniform`), so on the same logits both pick the same tokens unless u lands
within rounding of a cumulative boundary.
"""

from __future__ import annotations

import torch

from omniflow.errors import OmniflowError
from omniflow.kernels.timing import cuda_median_ms
from omniflow.kernels.triton_guard import dependent_launch, gdc_enter, jit, tl, triton

# Block of one pass over a row on the GPU (8 scores per thread with 16 warps); a candidate set
# of at most this many scores is searched in one block per pass.
BLOCK = 4096
NUM_WARPS = 16
# A codec's small vocabulary (a talker's 3,072 ids, a code predictor's 2,048) in blocks of
# 1,024 with 4 warps: its searches are bound by their block-wide reductions, cheaper across
# fewer warps (on an H100 a draw of 2,048 ids took 38 us launched from the host, 55 at the
# LM's shape; 3,072: 43-51 against 52-57; 151,936 ids: 235 us at the LM's shape, 403 at this).
SMALL_VOCAB, SMALL_BLOCK, SMALL_NUM_WARPS = 4096, 1024, 4


def launch_shape(vocab: int) -> tuple[int, int]:
    """The kernel's block and warps for rows of `vocab` logits."""
    return (SMALL_BLOCK, SMALL_NUM_WARPS) if vocab <= SMALL_VOCAB else (BLOCK, NUM_WARPS)


# Philox 4x32-10 as `tl.rand` runs it (triton/language/random.py).
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_ROUNDS = 10
_M32 = 0xFFFFFFFF
_INT_TO_UNIT = 4.6566127342e-10  # 2**-31, as tl.rand scales a non-negative int32


class SamplingError(OmniflowError):
    """Sampling inputs of the wrong shape or kind."""


@jit
def _bisect(
    score_ptr,
    n,
    lo,
    top,
    count,
    mass,
    top_score,
    k,
    budget,
    floor,
    floor_mass,
    skipped,
    until,
    TOP_P: tl.constexpr,
    WEIGHTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Narrow [lo, top] towards a filter's threshold over the scores `score_ptr[:n]`.

    `count` and `mass` are the number and weight (`exp(score - top_score)`, tallied where
    WEIGHTS) of the scores >= lo. Top-k asks whether at least k scores reach `mid`; top-p
    whether the weight of the scores in [floor, mid) — `skipped` of it from scores no longer
    in the array — is at most `budget * floor_mass`. Stops at the threshold (lo == top), or
    once no more than `until` scores reach lo."""
    lanes = tl.arange(0, BLOCK)
    inf = float("inf")
    mass = tl.full([], 0.0, tl.float32) + mass  # a loop-carried tensor, even if given a number
    while (lo < top) & (count > until):
        mid = lo * 0.5 + top * 0.5
        mid = tl.where(mid > lo, mid, top)
        count_l = tl.zeros([BLOCK], tl.int32)
        above_l = tl.zeros([BLOCK], tl.float32)
        below_l = tl.zeros([BLOCK], tl.float32)
        up_l = tl.full([BLOCK], inf, tl.float32)
        down_l = tl.full([BLOCK], -inf, tl.float32)
        for start in range(0, n, BLOCK):
            offs = start + lanes
            z = tl.load(score_ptr + offs, mask=offs < n, other=-inf)
            reach = z >= mid
            count_l += reach.to(tl.int32)
            if WEIGHTS:
                w = tl.exp(z - top_score)
                above_l += tl.where(reach, w, 0.0)
                below_l += tl.where(reach | (z < floor), 0.0, w)
            up_l = tl.minimum(up_l, tl.where(reach, z, inf))
            down_l = tl.maximum(down_l, tl.where(reach, -inf, z))
        reached = tl.sum(count_l, 0)
        up = tl.min(up_l, 0)
        if TOP_P:
            ok = skipped + tl.sum(below_l, 0) <= budget * floor_mass
            settled = top
        else:
            ok = reached >= k
            # Exactly k reach `up`: it is the k-th largest score.
            settled = tl.where(reached == k, up, top)
        lo = tl.where(ok, up, lo)
        count = tl.where(ok, reached, count)
        mass = tl.where(ok, tl.sum(above_l, 0), mass)
        top = tl.where(ok, settled, tl.max(down_l, 0))
    return lo, top, count, mass


@jit
def _compact(
    score_ptr, index_ptr, n, lo, floor, top_score, out_score_ptr, out_index_ptr,
    INDEXED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Copy the scores >= lo of `score_ptr[:n]`, and their token ids (`index_ptr`'s where
    INDEXED, else their positions), to the front of the out arrays, in order. Returns how
    many, their weight, and the weight of the scores in [floor, lo) left behind."""
    lanes = tl.arange(0, BLOCK)
    kept = 0
    mass_l = tl.zeros([BLOCK], tl.float32)
    skipped_l = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + lanes
        z = tl.load(score_ptr + offs, mask=offs < n, other=-float("inf"))
        keep = z >= lo
        token = tl.load(index_ptr + offs, mask=keep, other=0) if INDEXED else offs
        at = kept + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(out_score_ptr + at, z, mask=keep)
        tl.store(out_index_ptr + at, token, mask=keep)
        kept += tl.sum(keep.to(tl.int32), 0)
        weight = tl.exp(z - top_score)
        mass_l += tl.where(keep, weight, 0.0)
        skipped_l += tl.where(keep | (z < floor), 0.0, weight)
    return kept, tl.sum(mass_l, 0), tl.sum(skipped_l, 0)


@jit
def _sample_kernel(
    logits_ptr,
    seen_ptr,
    temperature_ptr,
    top_k_ptr,
    budget_ptr,
    penalty_ptr,
    seed_ptr,
    step_ptr,
    scratch_ptr,
    ids_ptr,
    mask_ptr,
    V,
    logits_stride,
    seen_stride,
    HAS_SEEN: tl.constexpr,
    WRITE_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
    GDC: tl.constexpr,
):
    gdc_enter(GDC)
    row = tl.program_id(0)
    logits = logits_ptr + row.to(tl.int64) * logits_stride
    seen = seen_ptr + row.to(tl.int64) * seen_stride
    mask = mask_ptr + row.to(tl.int64) * V
    # The row's scratch: its scores, then two generations of candidates (scores and ids).
    scores = scratch_ptr + row.to(tl.int64) * (5 * V)
    first_score = scores + V
    first_index = (scores + 2 * V).to(tl.pointer_type(tl.int32), bitcast=True)
    last_score = scores + 3 * V
    last_index = (scores + 4 * V).to(tl.pointer_type(tl.int32), bitcast=True)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0
    divisor = tl.where(greedy, 1.0, temperature)
    penalty = tl.load(penalty_ptr + row)
    lanes = tl.arange(0, BLOCK)
    inf = float("inf")

    # Pass 1: the scores (kept for the passes after, except on greedy rows, which need none)
    # and per-lane statistics, reduced once at the end.
    keep_scores = tl.where(greedy, 0, V)
    # A row without a penalty reads no seen mask: its loads are all masked off.
    read_seen = tl.where(penalty != 1.0, V, 0)
    max_l = tl.full([BLOCK], -inf, tl.float32)
    arg_l = tl.zeros([BLOCK], tl.int32) + V
    min_l = tl.full([BLOCK], inf, tl.float32)
    finite_l = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + lanes
        x = tl.load(logits + offs, mask=offs < V, other=-inf).to(tl.float32)
        if HAS_SEEN:
            hit = tl.load(seen + offs, mask=offs < read_seen, other=0) != 0
            x = tl.where(hit, tl.where(x < 0, x * penalty, tl.math.div_rn(x, penalty)), x)
        # Correctly rounded, as torch divides: the kept set must not depend on the division.
        z = tl.math.div_rn(x, divisor)
        tl.store(scores + offs, z, mask=offs < keep_scores)
        arg_l = tl.where(z > max_l, offs, arg_l)
        max_l = tl.maximum(max_l, z)
        finite = z > -inf
        min_l = tl.minimum(min_l, tl.where(finite, z, inf))
        finite_l += finite.to(tl.int32)
    top_score = tl.max(max_l, 0)
    best = tl.min(tl.where(max_l == top_score, arg_l, V), 0)
    best = tl.where(best < V, best, 0)

    if greedy:
        pick = best
        lo = top_score
    else:
        k = tl.load(top_k_ptr + row)
        budget = tl.load(budget_ptr + row)
        finite = tl.sum(finite_l, 0)
        lo = tl.min(min_l, 0)
        # Top-k over the whole row, counting only, until at most a block of scores reach lo;
        # those become the candidates, on which it ends.
        top = tl.where((k > 0) & (k < finite), top_score, lo)
        lo, top, count, mass = _bisect(
            scores, V, lo, top, finite, 0.0, top_score, k, budget, lo, 0.0, 0.0, BLOCK,
            TOP_P=False, WEIGHTS=False, BLOCK=BLOCK,
        )  # fmt: skip
        n, mass, _ = _compact(
            scores, scores, V, lo, lo, top_score, first_score, first_index,
            INDEXED=False, BLOCK=BLOCK,
        )  # fmt: skip
        lo, top, count, mass = _bisect(
            first_score, n, lo, top, n, mass, top_score, k, budget, lo, 0.0, 0.0, -1,
            TOP_P=False, WEIGHTS=True, BLOCK=BLOCK,
        )  # fmt: skip
        # Top-p on what top-k kept (floor and its mass) likewise: over the candidates until
        # at most a block reach lo, then over those.
        floor = lo
        floor_mass = mass
        top = tl.where(budget > 0, top_score, lo)
        lo, top, count, mass = _bisect(
            first_score, n, lo, top, count, mass, top_score, k,
            budget, floor, floor_mass, 0.0, BLOCK,
            TOP_P=True, WEIGHTS=True, BLOCK=BLOCK,
        )  # fmt: skip
        n, mass, skipped = _compact(
            first_score, first_index, n, lo, floor, top_score, last_score, last_index,
            INDEXED=True, BLOCK=BLOCK,
        )  # fmt: skip
        lo, top, count, mass = _bisect(
            last_score, n, lo, top, n, mass, top_score, k,
            budget, floor, floor_mass, skipped, -1,
            TOP_P=True, WEIGHTS=True, BLOCK=BLOCK,
        )  # fmt: skip

        # The draw: inverse CDF over the kept candidates, in id order.
        target = tl.rand(tl.load(seed_ptr + row), tl.load(step_ptr + row)) * mass
        cumulative = 0.0
        pick = -1
        start = 0
        while (start < n) & (pick < 0):
            offs = start + lanes
            z = tl.load(last_score + offs, mask=offs < n, other=-inf)
            weight = tl.where(z >= lo, tl.exp(z - top_score), 0.0)
            running = tl.cumsum(weight, 0) + cumulative
            first = tl.min(tl.where((running > target) & (offs < n), offs, n), 0)
            pick = tl.load(last_index + first, mask=first < n, other=-1)
            cumulative += tl.sum(weight, 0)
            start += BLOCK
        pick = tl.where(pick < 0, best, pick)
    tl.store(ids_ptr + row, pick.to(tl.int64))

    if WRITE_MASK:
        for start in range(0, V, BLOCK):
            offs = start + lanes
            if greedy:
                allowed = offs == pick
            else:
                allowed = tl.load(scores + offs, mask=offs < V, other=-inf) >= lo
            tl.store(mask + offs, allowed, mask=offs < V)


# --- parameters --------------------------------------------------------------------------------


class Params:
    """Per-row sampling parameters as `[B]` tensors on one device; numbers are broadcast.

    A decode loop can keep one and update it on the device (`step += 1`). top_p is held in
    float64 so that top-p's budget, `1 - top_p`, is computed as Python computes it in
    `_warp`, then rounded to float32 as the comparison there rounds it.
    """

    def __init__(
        self, rows: int, device, *, temperature, top_k, top_p, repetition_penalty, seed, step
    ):
        self.temperature = _rows(temperature, rows, torch.float32, device, "temperature")
        self.top_k = _rows(top_k, rows, torch.int32, device, "top_k")
        self.top_p = _rows(top_p, rows, torch.float64, device, "top_p")
        self.penalty = _rows(repetition_penalty, rows, torch.float32, device, "repetition_penalty")
        self.seed = _rows(seed, rows, torch.int64, device, "seed")
        self.step = _rows(step, rows, torch.int64, device, "step")
        # The weight at or below which top-p drops a token, as a share of the total (0: off).
        self.budget = torch.where(self.top_p < 1, 1 - self.top_p, 0).float()

    @classmethod
    def of_buffers(
        cls, *, temperature, top_k, top_p, budget, repetition_penalty, seed, step
    ) -> Params:
        """Params over `[B]` tensors the caller owns, kept as they are (no copies): a decode
        loop replayed from a CUDA graph keeps its parameters in static buffers and updates
        them in place. Each must already have its field's dtype (`budget` float32, as
        `__init__` derives it from top_p)."""
        params = cls.__new__(cls)
        params.temperature, params.top_k, params.top_p = temperature, top_k, top_p
        params.penalty, params.seed, params.step = repetition_penalty, seed, step
        params.budget = budget
        return params


def _rows(value, rows: int, dtype: torch.dtype, device, name: str) -> torch.Tensor:
    if not torch.is_tensor(value):
        return torch.full((rows,), value, dtype=dtype, device=device)
    if value.dim() > 1 or value.numel() not in (1, rows):
        raise SamplingError(f"{name} has shape {list(value.shape)}; expected [{rows}] or a number")
    return value.to(device, dtype).reshape(-1).expand(rows).contiguous()


def _check(logits: torch.Tensor, seen: torch.Tensor | None) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise SamplingError(
            f"logits must be [B, V] floats, not {list(logits.shape)} {logits.dtype}"
        )
    if seen is not None and (seen.shape != logits.shape or seen.dtype != torch.bool):
        raise SamplingError(
            f"seen must be a bool mask of the logits' shape {list(logits.shape)}, "
            f"not {list(seen.shape)} {seen.dtype}"
        )


# --- the kernel, the reference, and the wrapper ------------------------------------------------


def sample_triton(
    logits: torch.Tensor,
    params: Params,
    seen: torch.Tensor | None = None,
    *,
    with_mask: bool = False,
    block: int | None = None,
    num_warps: int | None = None,
    out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the Triton kernel: ids `[B]` int64 and, with `with_mask`, the kept set `[B, V]`
    (for greedy rows, the chosen token). Any device Triton can run on, including the CPU
    under `TRITON_INTERPRET=1`. `out` (`[B]` int64) and `scratch` (`[B, 5 V]` float32,
    contiguous) are buffers to use instead of fresh ones: a CUDA graph captures the call
    with its buffers fixed. `block` and `num_warps` default to the vocabulary's
    `launch_shape`."""
    _check(logits, seen)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    device = logits.device
    shape = launch_shape(vocab)
    block, num_warps = block or shape[0], num_warps or shape[1]
    ids = torch.empty(rows, dtype=torch.int64, device=device) if out is None else out
    # Without `with_mask` the kernel writes no mask; `ids` only fills the argument.
    mask = torch.empty(rows, vocab, dtype=torch.bool, device=device) if with_mask else ids
    if seen is not None and seen.stride(-1) != 1:
        seen = seen.contiguous()
    # Per row: its scores and two generations of candidates' scores and ids (20 bytes a token).
    if scratch is None:
        scratch = torch.empty(rows, 5 * vocab, dtype=torch.float32, device=device)
    elif scratch.shape != (rows, 5 * vocab) or not scratch.is_contiguous():
        raise SamplingError(f"scratch must be a contiguous float32 [{rows}, {5 * vocab}]")
    if rows:
        _sample_kernel[(rows,)](
            logits,
            logits if seen is None else seen,
            params.temperature,
            params.top_k,
            params.budget,
            params.penalty,
            params.seed,
            params.step,
            scratch,
            ids,
            mask,
            vocab,
            logits.stride(0),
            0 if seen is None else seen.stride(0),
            HAS_SEEN=seen is not None,
            WRITE_MASK=with_mask,
            BLOCK=block,
            num_warps=num_warps,
            **dependent_launch(logits),
        )
    return ids, mask if with_mask else None


def uniform(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """`tl.rand(seed, step)` per element, with torch integer ops: Philox 4x32-10 keyed by the
    seed's two halves, counting from the step's, its first word scaled to [0, 1)."""
    c0, c1 = step & _M32, (step >> 32) & _M32
    c2 = c3 = torch.zeros_like(c0)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(_ROUNDS):
        hi_b, lo_b = _mul32(_ROUND_B, c2)
        hi_a, lo_a = _mul32(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    # tl.rand reads the word as int32 and flips negative ones: `~x` is `M32 - x` unsigned.
    x = torch.where(c0 > 0x7FFFFFFF, _M32 - c0, c0)
    return x.float() * torch.tensor(_INT_TO_UNIT, dtype=torch.float32, device=x.device)


def _mul32(a: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of `a * x` for 32-bit `a` and `x` held in int64, without
    overflowing: `a` is split into 16-bit halves."""
    low = x * (a & 0xFFFF)
    mid = x * (a >> 16) + (low >> 16)
    return mid >> 16, ((mid & 0xFFFF) << 16) | (low & 0xFFFF)


def reference_filter(
    logits: torch.Tensor, params: Params, seen: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort-based, as `_warp` after the backend's penalty: the penalized logits `[B, V]`
    (what greedy rows take the argmax of), the filtered scores (-inf where dropped), and
    the kept set `[B, V]` (for greedy rows, the argmax)."""
    _check(logits, seen)
    x = logits.float()
    if seen is not None:
        penalty = params.penalty[:, None]
        x = torch.where(seen, torch.where(x < 0, x * penalty, x / penalty), x)
    greedy = (params.temperature == 0)[:, None]
    scores = x / torch.where(greedy, 1.0, params.temperature[:, None])
    vocab = x.shape[1]
    top_k = params.top_k.long()
    if ((top_k > 0) & (top_k < vocab)).any():
        kth = scores.sort(dim=-1, descending=True).values.gather(
            1, (top_k.clamp(1, vocab) - 1)[:, None]
        )
        on = ((top_k > 0) & (top_k < vocab))[:, None]
        scores = scores.masked_fill(on & (scores < kth), -float("inf"))
    if (params.top_p < 1).any():
        ordered, order = torch.sort(scores, dim=-1)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= params.budget[:, None]
        drop[:, -1] = False  # the most likely token always stays
        drop &= (params.top_p < 1)[:, None]
        scores = scores.masked_fill(drop.scatter(1, order, drop), -float("inf"))
    argmax = torch.zeros_like(scores, dtype=torch.bool).scatter_(
        1, x.argmax(-1, keepdim=True), True
    )
    kept = torch.where(greedy, argmax, scores > -float("inf"))
    return x, scores, kept


def reference(
    logits: torch.Tensor, params: Params, seen: torch.Tensor | None = None
) -> torch.Tensor:
    """The kernel's computation in torch ops: `reference_filter`, then the same inverse-CDF
    draw with the same uniforms. Ids `[B]` int64."""
    x, scores, kept = reference_filter(logits, params, seen)
    top = scores.max(-1, keepdim=True).values
    weight = torch.where(kept, (scores - top).exp(), 0.0)
    cumulative = weight.cumsum(-1)
    target = uniform(params.seed, params.step)[:, None] * cumulative[:, -1:]
    crossed = cumulative > target
    best = x.argmax(-1)
    pick = torch.where(crossed.any(-1), crossed.int().argmax(-1), best)
    return torch.where(params.temperature == 0, best, pick)


def sample(
    logits: torch.Tensor,
    *,
    temperature,
    top_k=-1,
    top_p=1.0,
    repetition_penalty=1.0,
    seed=0,
    step=0,
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sampled ids `[B]` int64 for `[B, V]` logits. Each parameter is a `[B]` tensor or a
    number for every row; `seen` is the `[B, V]` bool mask the repetition penalty applies
    to. The Triton kernel on CUDA, the torch reference elsewhere."""
    _check(logits, seen)
    params = Params(
        logits.shape[0],
        logits.device,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        step=step,
    )
    if logits.is_cuda and triton is not None:
        return sample_triton(logits, params, seen)[0]
    return reference(logits, params, seen)


def benchmark_inputs(rows: int, vocab: int = 152064, device="cuda", **settings):
    """A decode step's inputs: `[rows, vocab]` logits (Gaussian, std 3), 512 seen tokens per
    row, per-row seeds, and `settings` (Qwen2.5's generation defaults unless given:
    temperature 0.7, top-k 20, top-p 0.8, repetition penalty 1.05)."""
    g = torch.Generator(device).manual_seed(0)
    logits = torch.randn(rows, vocab, device=device, generator=g) * 3
    seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
    seen.scatter_(1, torch.randint(vocab, (rows, 512), device=device, generator=g), True)
    chosen = {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05, **settings}
    seeds = torch.arange(rows, device=device)
    return logits, seen, Params(rows, device, seed=seeds, step=7, **chosen)


def benchmark(rows: int = 8, vocab: int = 152064, iters: int = 50, **settings) -> dict[str, float]:
    """Median milliseconds of the kernel and the batched reference on CUDA, for one decode
    step of `benchmark_inputs`, ids read back to the host (as a decode step needs them)."""
    logits, seen, params = benchmark_inputs(rows, vocab, **settings)
    return {
        "triton": cuda_median_ms(lambda: sample_triton(logits, params, seen)[0].tolist(), iters),
        "torch": cuda_median_ms(lambda: reference(logits, params, seen).tolist(), iters),
    }


if __name__ == "__main__":
    for rows in (1, 8, 32):
        print(f"B={rows}", benchmark(rows))
