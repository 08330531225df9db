"""Block-local attention: the kernel (interpreted on the CPU, compiled on a GPU) gives the
reference's outputs — SDPA over the whole window with the block mask — at every real
position, for each reach token2wav's DiT layers use, with windows padded on either side;
padding positions stay finite; shapes are checked."""

import pytest
import torch

from omniflow.kernels import block_attention as attention

PAD = 1 << 30  # a padding position's block, as token2wav's windows mark it
# (rows, positions, heads, head dim, block size, each row's (offset, length) in positions)
SHAPES = [
    (2, 150, 2, 16, 24, [(0, 150), (0, 150)]),  # whole rows over three query tiles
    (3, 150, 2, 32, 24, [(10, 100), (0, 131), (37, 113)]),  # padded before, after, both
    (1, 40, 1, 16, 4, [(3, 30)]),  # short blocks: many per tile
]
REACHES = [(0, 0), (1, 0), (0, 1)]


def operands(shape, dtype: torch.dtype) -> tuple:
    rows, length, heads, d, size, spans = shape
    g = torch.Generator().manual_seed(rows * 1000 + length + d)
    qkv = torch.randn(rows, length, 3, heads, d, generator=g).to(dtype)
    q, k, v = qkv.unbind(2)  # strided views, as the fused product gives them
    position = torch.arange(length)[None] - torch.tensor([o for o, _ in spans])[:, None]
    real = (position >= 0) & (position < torch.tensor([n for _, n in spans])[:, None])
    blocks = torch.where(real, position.div(size, rounding_mode="floor"), PAD)
    return q, k, v, blocks, size, real


def cases() -> list[tuple]:
    return [
        (*operands(s, dtype)[:4], back, ahead, s[4])
        for s in SHAPES
        for dtype in (torch.float32, torch.bfloat16)
        for back, ahead in REACHES
    ]


def run_kernel(found: list[tuple]) -> list[torch.Tensor]:
    """Runs under TRITON_INTERPRET=1."""
    return [attention.block_attention_triton(*args) for args in found]


def assert_agree_where_real(got: torch.Tensor, want: torch.Tensor, blocks: torch.Tensor):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.isfinite(got.float()).all()
    real = blocks != PAD
    tol = 2e-5 if got.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[real].float(), want[real].float(), rtol=tol, atol=tol)


def test_kernel_agrees_with_the_reference_at_real_positions(interpret):
    found = cases()
    for args, out in zip(found, interpret(run_kernel, found), strict=True):
        assert_agree_where_real(out, attention.reference(*args), args[3])


def test_the_reference_is_token2wavs_layers_masked_attention():
    """Block distances as transformers' DiT layers take them: query i sees key j where
    -back <= block[j] - block[i] <= ahead."""
    q, k, v, blocks, size, _ = operands(SHAPES[1], torch.float32)
    mask = attention.block_mask(blocks, 1, 0, torch.float32)[1, 0]
    assert mask[60, 24] == 0 and mask[60, 23] == float("-inf")  # blocks 2 and 1, not 0
    assert mask[60, 72] == float("-inf")  # one block ahead: not with ahead=0
    assert mask[60, 140] == float("-inf")  # padding: seen by no real position


def test_shapes_are_checked():
    q, k, v, blocks, size, _ = operands(SHAPES[0], torch.float32)
    with pytest.raises(attention.BlockAttentionError, match="blocks must be"):
        attention.block_attention(q, k, v, blocks[:, 1:], 0, 0, size)
    with pytest.raises(attention.BlockAttentionError, match="alike"):
        attention.block_attention(q, k[:, 1:], v, blocks, 0, 0, size)


@pytest.mark.gpu
def test_kernel_agrees_with_the_reference_on_gpu(on_cuda):
    for args in cases():
        on = on_cuda(args)
        assert_agree_where_real(attention.block_attention(*on), attention.reference(*on), on[3])
    # token2wav's shape: ten 240-code windows with guidance, bf16, the last two padded
    spans = [(0, 480)] * 18 + [(96, 384), (0, 300)]
    q, k, v, blocks, size, _ = operands((20, 480, 16, 64, 24, spans), torch.bfloat16)
    on = on_cuda((q, k, v, blocks))
    for back, ahead in REACHES:
        args = (*on, back, ahead, size)
        assert_agree_where_real(attention.block_attention(*args), attention.reference(*args), on[3])
