"""One key tile into a running (online) softmax, as flash attention takes it: the step the
attention kernels (`decode_attention`, `block_attention`) share, a Triton device function.

Numerics: scores, the running max and sum in float32; the probabilities rounded to the
values' dtype for their product with them (float32 products where `IN_FLOAT32`). A query
that has seen no key yet (its scores all -inf) keeps weights of 0, not NaN.
"""

from __future__ import annotations

from omniflow.kernels.triton_guard import jit, tl


@jit
def online_softmax_tile(top, total, acc, scores, values, IN_FLOAT32: tl.constexpr):
    """`scores` `[M, N]` (-inf where a key is not seen) and the tile's `values` `[N, D]`
    into the running max `top` `[M]`, sum `total` `[M]` and weighted values `acc` `[M, D]`:
    returns the three updated."""
    new_top = tl.maximum(top, tl.max(scores, 1))
    safe_top = tl.where(new_top == float("-inf"), 0.0, new_top)
    p = tl.exp(scores - safe_top[:, None])
    keep = tl.exp(top - safe_top)
    total = total * keep + tl.sum(p, 1)
    pv = tl.dot(p.to(values.dtype), values, input_precision="ieee" if IN_FLOAT32 else "tf32")
    return new_top, total, acc * keep[:, None] + pv
