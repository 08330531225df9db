"""The MMDiT q/k norm + rotary + joint placement: its reference is diffusers' ops, and its
Triton kernel (interpreted on the CPU, compiled on a GPU) agrees with the reference."""

import pytest
import torch
from diffusers.models.normalization import RMSNorm
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

from omniflow.kernels import qk_norm_rope

# (batch, stream tokens, joint tokens, offset, heads, head width): heads and pairs below, not
# divisible by, and at a power of two.
SHAPES = [(1, 5, 9, 4, 3, 16), (2, 7, 7, 0, 4, 8), (2, 3, 11, 8, 5, 6), (1, 1, 2, 1, 1, 128)]


def cases() -> list[dict]:
    found = []
    g = torch.Generator().manual_seed(0)
    for batch, tokens, joint, offset, heads, width in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            angles = torch.rand(tokens, width // 2, generator=g) * 6
            found.append(
                {
                    "qkv": (torch.randn(batch * tokens, 3 * heads * width, generator=g) * 3).to(
                        dtype
                    ),
                    "q_weight": torch.rand(width, generator=g).to(dtype) + 0.5,
                    "k_weight": torch.rand(width, generator=g).to(dtype) + 0.5,
                    "freqs": torch.polar(torch.ones_like(angles), angles),
                    "q": torch.zeros(batch, joint, heads, width, dtype=dtype),
                    "k": torch.zeros(batch, joint, heads, width, dtype=dtype),
                    "v": torch.zeros(batch, joint, heads, width, dtype=dtype),
                    "offset": offset,
                    "eps": 1e-6,
                }
            )
            # Wan's: one norm over every head (weights [H * Dh]).
            across = torch.rand(2, heads * width, generator=g).to(dtype) + 0.5
            found.append(
                {**found[-1], "q_weight": across[0], "k_weight": across[1], "across_heads": True}
            )
    return found


def outputs(case: dict, fn) -> tuple[torch.Tensor, ...]:
    case = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    fn(**case)
    return case["q"], case["k"], case["v"]


def run_kernel(found: list[dict]) -> list[tuple[torch.Tensor, ...]]:
    """Runs under TRITON_INTERPRET=1."""
    return [outputs(case, qk_norm_rope.qk_norm_rope_triton) for case in found]


def assert_agree(got, want, steps: int) -> None:
    """Within `steps` steps of the dtype at each tensor's largest magnitude."""
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        tol = 1e-5 if a.dtype == torch.float32 else steps * 2**-7
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * b.abs().max())


def test_the_reference_is_diffusers_ops():
    batch, tokens, heads, width = 2, 5, 3, 8
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        qkv = torch.randn(batch * tokens, 3 * heads * width, generator=g).to(dtype)
        norm_q, norm_k = RMSNorm(width, eps=1e-6).to(dtype), RMSNorm(width, eps=1e-6).to(dtype)
        with torch.no_grad():
            norm_q.weight.uniform_(0.5, 1.5, generator=g)
            norm_k.weight.uniform_(0.5, 1.5, generator=g)
        angles = torch.rand(tokens, width // 2, generator=g)
        freqs = torch.polar(torch.ones_like(angles), angles)
        text = torch.randn(batch, 2, heads, width, generator=g).to(dtype)
        query, key, value = qkv.view(batch, tokens, 3, heads, width).unbind(2)
        with torch.no_grad():
            want = [
                torch.cat([text, part], dim=1)
                for part in (
                    apply_rotary_emb_qwen(norm_q(query), freqs, use_real=False),
                    apply_rotary_emb_qwen(norm_k(key), freqs, use_real=False),
                    value,
                )
            ]
            joint = [torch.cat([text, torch.zeros_like(value)], dim=1) for _ in range(3)]
            qk_norm_rope.reference(qkv, norm_q.weight, norm_k.weight, freqs, *joint, 2, 1e-6)
        for got, expected in zip(joint, want, strict=True):
            assert torch.equal(got, expected)


def test_across_heads_is_wans_ops():
    """`WanAttnProcessor`'s: `torch.nn.RMSNorm` over all heads, then its real rotary of
    (even, odd) pairs by `WanRotaryPosEmbed`'s (cos, sin) (float32, as Wan keeps them)."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    batch, heads, width, grid = 2, 3, 16, (2, 2, 3)
    tokens = grid[0] * grid[1] * grid[2]
    g = torch.Generator().manual_seed(3)
    cos, sin = WanRotaryPosEmbed(width, (1, 2, 2), 64)(
        torch.zeros(batch, 1, grid[0], 2 * grid[1], 2 * grid[2])
    )
    freqs = torch.complex(cos[0, :, 0, 0::2].float(), sin[0, :, 0, 1::2].float())
    for dtype in (torch.float32, torch.bfloat16):
        qkv = torch.randn(batch * tokens, 3 * heads * width, generator=g).to(dtype)
        norm = torch.nn.RMSNorm(heads * width, eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5, generator=g)
        query = qkv.view(batch, tokens, 3, heads * width)[:, :, 0]
        normed = norm(query).unflatten(2, (heads, width))
        x1, x2 = normed.unflatten(-1, (-1, 2)).unbind(-1)
        c, s_ = cos[..., 0::2].float(), sin[..., 1::2].float()
        want = torch.empty_like(normed)
        want[..., 0::2], want[..., 1::2] = x1 * c - x2 * s_, x1 * s_ + x2 * c
        q, k, v = (torch.zeros(batch, tokens, heads, width, dtype=dtype) for _ in range(3))
        with torch.no_grad():
            qk_norm_rope.reference(
                qkv, norm.weight, norm.weight, freqs, q, k, v, 0, 1e-6, across_heads=True
            )
        assert torch.equal(q, want)


def test_kernel_agrees_with_the_reference(interpret):
    """Triton's interpreter rounds float32 to bfloat16 towards zero (the GPU to nearest), so
    interpreted bf16 results may sit a few steps off."""
    found = cases()
    for case, got in zip(found, interpret(run_kernel, found), strict=True):
        assert_agree(got, outputs(case, qk_norm_rope.reference), steps=4)


def test_shapes_are_checked():
    case = cases()[0]
    with pytest.raises(qk_norm_rope.QkNormRopeError, match="do not fit"):
        qk_norm_rope.qk_norm_rope(**{**case, "offset": 5})
    with pytest.raises(qk_norm_rope.QkNormRopeError, match="freqs must be"):
        qk_norm_rope.qk_norm_rope(**{**case, "freqs": case["freqs"][1:]})
    with pytest.raises(qk_norm_rope.QkNormRopeError, match="one shape"):
        qk_norm_rope.qk_norm_rope(**{**case, "v": case["v"][:, 1:]})


@pytest.mark.gpu
def test_kernel_agrees_with_the_reference_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for case in cases():
        on = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
        assert_agree(outputs(on, qk_norm_rope.qk_norm_rope), outputs(on, qk_norm_rope.reference), 2)
