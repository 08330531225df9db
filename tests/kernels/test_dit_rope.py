"""The first head's rotary of token2wav's DiT: its reference is transformers' own functions
applied as `DiTAttention` applies them, and its Triton kernel (interpreted on the CPU,
compiled on a GPU) gives the reference's bits."""

import pytest
import torch

from omniflow.kernels import dit_rope

# (rows, heads, head dim)
SHAPES = [(1, 1, 2), (5, 2, 8), (7, 16, 64), (3, 3, 32)]


def cases() -> list[dict]:
    found = []
    g = torch.Generator().manual_seed(0)
    for rows, heads, d in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            qkv = torch.randn(rows, 3 * heads * d + 5, generator=g).to(dtype)[:, :-5]  # strided
            angle = torch.randn(rows, d // 2, generator=g).repeat(1, 2) * 3
            found.append(
                {
                    "qkv": qkv,
                    "cos": angle.cos().to(dtype),
                    "sin": angle.sin().to(dtype),
                    "heads": heads,
                }
            )
    return found


def run_kernel(found: list[dict]) -> list[torch.Tensor]:
    """Runs under TRITON_INTERPRET=1."""
    return [dit_rope.rope_first_head_triton(**{**c, "qkv": c["qkv"].clone()}) for c in found]


def test_the_reference_is_dit_attention_rotation():
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        apply_rotary_pos_emb,
        deinterleave_head_dim,
    )

    case = cases()[4]
    qkv, heads = case["qkv"].clone(), case["heads"]
    d = qkv.shape[1] // (3 * heads)
    query = qkv[:, : heads * d].reshape(-1, 1, heads, d).transpose(1, 2).clone()
    key = qkv[:, heads * d : 2 * heads * d].reshape(-1, 1, heads, d).transpose(1, 2).clone()
    cos, sin = case["cos"][:, None], case["sin"][:, None]  # [R, T=1, d]
    query[:, :1], key[:, :1] = apply_rotary_pos_emb(
        deinterleave_head_dim(query[:, :1]), deinterleave_head_dim(key[:, :1]), cos, sin
    )
    got = dit_rope.reference(qkv, case["cos"], case["sin"], heads)
    assert torch.equal(got[:, : heads * d], query.transpose(1, 2).reshape(-1, heads * d))
    assert torch.equal(
        got[:, heads * d : 2 * heads * d], key.transpose(1, 2).reshape(-1, heads * d)
    )
    assert torch.equal(got[:, 2 * heads * d :], case["qkv"][:, 2 * heads * d :])  # v untouched
    assert not torch.equal(got, case["qkv"])


def test_kernel_gives_the_reference_bits(interpret):
    """Float32 exactly; bf16 within a few steps (the interpreter rounds bf16 towards zero, at
    each of the three roundings)."""
    found = cases()
    for case, got in zip(found, interpret(run_kernel, found), strict=True):
        want = dit_rope.reference(**{**case, "qkv": case["qkv"].clone()})
        if got.dtype == torch.float32:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-5, atol=2**-5)


def test_shapes_are_checked():
    with pytest.raises(dit_rope.DiTRopeError, match="not an even power of two"):
        dit_rope.rope_first_head(torch.zeros(2, 18), torch.zeros(2, 6), torch.zeros(2, 6), 1)
    with pytest.raises(dit_rope.DiTRopeError, match="cos/sin"):
        dit_rope.rope_first_head(torch.zeros(2, 24), torch.zeros(2, 4), torch.zeros(2, 8), 1)


@pytest.mark.gpu
def test_kernel_agrees_with_the_reference_on_gpu():
    """Within a step of the dtype: the compiled kernel may contract a product and the sum
    into one rounding (float32) where the reference rounds twice."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for case in cases():
        on = {k: v.cuda() if torch.is_tensor(v) else v for k, v in case.items()}
        got = dit_rope.rope_first_head(**{**on, "qkv": on["qkv"].clone()})
        want = dit_rope.reference(**{**on, "qkv": on["qkv"].clone()})
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-5)
