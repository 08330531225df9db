"""A decode step's attention with each row's columns read on the device: the kernels
(interpreted on the CPU, compiled on a GPU) agree with the reference, the static step's
SDPA over a length bucket; a row reads nothing past its last column; one chunk (written
at once) or many (combined)."""

import pytest
import torch

from omniflow.kernels import decode_attention as attention

# (rows, kv heads, query heads per kv head, head dim, cache columns, each row's last column)
SHAPES = [
    (1, 2, 2, 16, 64, [37]),  # one chunk
    (3, 2, 3, 32, 640, [0, 300, 639]),  # three chunks: a row in each, one at the very end
    (2, 1, 1, 16, 128, [5, 500]),  # a row past the cache: clamped to its last column
    (4, 2, 2, 16, 16, [0, 3, 15, 7]),  # a code predictor's frame: 16 columns
]


def operands(shape, dtype: torch.dtype, stale: float | None = None) -> tuple:
    """Queries, a cache with one slot more than rows, the rows' last columns, the scale;
    with `stale`, every column past a row's last holds that value (a column no step read)."""
    b, heads, group, d, columns, last = shape
    g = torch.Generator().manual_seed(b * 1000 + columns)
    q = torch.randn(b, heads, group, d, generator=g).to(dtype)
    keys, values = (torch.randn(b + 1, heads, columns, d, generator=g).to(dtype) for _ in "kv")
    filled = torch.tensor(last)
    if stale is not None:
        for row, end in enumerate(last):
            keys[row, :, end + 1 :] = values[row, :, end + 1 :] = stale
    return q, keys, values, filled, d**-0.5


def cases() -> list[tuple]:
    return [operands(s, dtype) for s in SHAPES for dtype in (torch.float32, torch.bfloat16)]


def slotted() -> tuple:
    """Four rows naming their slots: two positions of slot 1 (columns 0 and 1, as a
    sequence's two positions written in one step), slot 0's column 5, slot 2's column 15."""
    q, keys, values, _, scale = operands((4, 2, 2, 16, 16, [0] * 4), torch.float32)
    return q, keys, values, torch.tensor([0, 1, 5, 15]), scale, torch.tensor([1, 1, 0, 2])


def run_kernel(found: list[tuple]) -> list[torch.Tensor]:
    """Runs under TRITON_INTERPRET=1: each case, then the second shape's in float32 with NaN
    past each row's last column, then the rows naming their slots."""
    stale = operands(SHAPES[1], torch.float32, stale=float("nan"))
    return [attention.decode_attention_triton(*args) for args in [*cases(), stale, slotted()]]


def assert_agree(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 2e-5 if got.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_kernel_agrees_with_the_reference(interpret):
    found = cases()
    *got, stale, by_slot = interpret(run_kernel, found)
    for args, out in zip(found, got, strict=True):
        assert_agree(out, attention.reference(*args))
    assert_agree(stale, got[2])  # the same shape, its stale columns never read
    *args, slots = slotted()
    assert_agree(by_slot, attention.reference(*args, slots=slots))


def test_a_row_naming_its_slot_reads_that_slot():
    """The reference over `slots` is the reference over those slots' caches gathered."""
    q, keys, values, filled, scale, slots = slotted()
    gathered = attention.reference(q, keys[slots], values[slots], filled, scale)
    torch.testing.assert_close(
        attention.reference(q, keys, values, filled, scale, slots=slots), gathered
    )
    with pytest.raises(attention.DecodeAttentionError, match="slots must be"):
        attention.decode_attention(q, keys, values, filled, scale, slots[:2])


def test_the_reference_over_a_length_bucket_is_the_whole_caches():
    """What the static step computes at a bucket T past every row's last column is what the
    kernel computes over the whole cache."""
    q, keys, values, filled, scale = operands(SHAPES[1], torch.float32)
    whole = attention.reference(q, keys, values, filled, scale)
    bucket = attention.reference(q, keys, values, filled, scale, length=640)
    torch.testing.assert_close(bucket, whole)
    q, keys, values, filled, scale = operands(SHAPES[0], torch.float32)
    whole = attention.reference(q, keys, values, filled, scale)
    torch.testing.assert_close(attention.reference(q, keys, values, filled, scale, 38), whole)


def test_splits_fill_the_gpu_in_chunks_of_the_cache():
    """As many chunks as give each of 132 SMs 4 programs, within the cache's chunks."""
    assert attention.splits_for(64, 8, 132) == 1  # one chunk's worth of columns
    assert attention.splits_for(640, 8, 132) == 3
    assert attention.splits_for(4096, 8, 132) == 16  # batch 1, 8 heads
    assert attention.splits_for(4096, 16 * 8, 132) == 5
    assert attention.splits_for(4096, 64 * 8, 132) == 2
    assert attention.splits_for(4096, 1024, 132) == 1
    assert attention.splits_for(1 << 20, 1, 132) == attention.MAX_SPLITS


def test_shapes_are_checked():
    q, keys, values, filled, scale = operands(SHAPES[0], torch.float32)
    with pytest.raises(attention.DecodeAttentionError, match="filled must be"):
        attention.decode_attention(q, keys, values, filled[:0], scale)
    with pytest.raises(attention.DecodeAttentionError, match="does not hold"):
        attention.decode_attention(q, keys[:, :1], values[:, :1], filled, scale)


@pytest.mark.gpu
def test_kernel_agrees_with_the_reference_on_gpu(on_cuda):
    for args in cases():
        on = on_cuda(args)
        assert_agree(attention.decode_attention(*on), attention.reference(*on))
    big = operands((16, 8, 2, 128, 4096, list(range(0, 4096, 256))), torch.bfloat16)
    on = on_cuda(big)
    assert_agree(attention.decode_attention(*on), attention.reference(*on))
    *on, slots = on_cuda(slotted())
    got = attention.decode_attention(*on, slots=slots)
    assert_agree(got, attention.reference(*on, slots=slots))
