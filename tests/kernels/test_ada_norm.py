"""The gated residual add + adaptive LayerNorm: its reference is transformers'
DiTDecoderLayer ops, and its Triton kernel (interpreted on the CPU, compiled on a GPU)
agrees with the reference."""

import pytest
import torch
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5_OmniAdaLayerNormZero

from omniflow.kernels import ada_norm

# (modulation rows, rows each, width): widths below, not divisible by, and at a block.
SHAPES = [(1, 3, 64), (2, 5, 100), (3, 1, 1024), (1, 7, 4)]


def cases() -> list[dict]:
    found = []
    g = torch.Generator().manual_seed(0)
    for mods, per, width in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):

            def draw(*shape, g=g, dtype=dtype):
                return torch.randn(*shape, generator=g).to(dtype)

            x, delta = draw(mods * per, width) * 3, draw(mods * per, width)
            chunks = draw(mods, 3 * width).chunk(3, dim=1)  # strided views, as the adaLN's
            found.append({"x": x, "shift": chunks[0], "scale": chunks[1]})
            found.append(
                {"x": x, "shift": chunks[0], "scale": chunks[1], "delta": delta, "gate": chunks[2]}
            )
            # Wan's: float32 modulation rounded once, a fixed affine (one row) after a
            # residual gated per modulation row.
            wan = torch.randn(mods, 3 * width, generator=g).chunk(3, dim=1)
            affine = torch.randn(2, width, generator=g)
            found.append({"x": x, "shift": wan[0], "scale": wan[1], "round_once": True})
            found.append(
                {"x": x, "shift": affine[:1], "scale": affine[1:], "delta": delta,
                 "gate": wan[2], "round_once": True}
            )  # fmt: skip
    return found


def run_kernel(found: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Runs under TRITON_INTERPRET=1."""
    return [ada_norm.ada_norm_triton(**case) for case in found]


def assert_agree(got, want, steps: int = 1) -> None:
    """Within `steps` steps of the output dtype at the tensor's largest magnitude (a step
    of the product before `+ shift` survives the add where it cancels)."""
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        tol = 1e-5 if a.dtype == torch.float32 else steps * 2**-7
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * b.abs().max())


def test_the_reference_is_transformers_layer_ops():
    """transformers' AdaLayerNormZero (its norm and modulation), given the same chunks, and
    the layer's `hidden + gate.unsqueeze(1) * delta`."""
    width, per = 64, 5
    module = Qwen2_5_OmniAdaLayerNormZero(width)
    g = torch.Generator().manual_seed(1)
    hidden, delta = torch.randn(2, per, width, generator=g), torch.randn(2, per, width, generator=g)
    emb = torch.randn(2, width, generator=g)
    with torch.no_grad():
        want, gate, *_ = module(hidden, emb)
        shift, scale, *_ = module.linear(module.silu(emb)).chunk(6, dim=1)
        got, total = ada_norm.reference(hidden.reshape(-1, width), shift, scale)
        assert torch.equal(total, hidden.reshape(-1, width))
        assert torch.equal(got.view(2, per, width), want)
        summed = hidden + gate.unsqueeze(1) * delta
        _, total = ada_norm.reference(
            hidden.reshape(-1, width), shift, scale, delta.reshape(-1, width), gate
        )
        assert torch.equal(total.view(2, per, width), summed)


def test_round_once_is_wans_block_ops():
    """`WanTransformerBlock`'s: `(norm(x.float()) * (1 + scale) + shift).type_as(x)` with float32
    modulation, and `(x.float() + delta * gate).type_as(x)` before its affine norm."""
    from diffusers.models.normalization import FP32LayerNorm

    g = torch.Generator().manual_seed(2)
    width = 64
    x, delta = (torch.randn(6, width, generator=g).bfloat16() for _ in range(2))
    shift, scale, gate = torch.randn(2, 3 * width, generator=g).chunk(3, dim=1)
    norm = FP32LayerNorm(width, 1e-6, elementwise_affine=False)
    affine = FP32LayerNorm(width, 1e-6, elementwise_affine=True)
    with torch.no_grad():
        affine.weight.uniform_(0.5, 1.5, generator=g)
        affine.bias.uniform_(-1, 1, generator=g)
        rows = x.view(2, 3, width)
        want = (norm(rows.float()) * (1 + scale[:, None]) + shift[:, None]).type_as(x)
        got, _ = ada_norm.reference(x, shift, scale, round_once=True)
        assert torch.equal(got, want.view(6, width))
        summed = (rows.float() + delta.view(2, 3, width) * gate[:, None]).type_as(x)
        want = affine(summed.float()).type_as(x)
        got, total = ada_norm.reference(
            x, affine.bias[None], (affine.weight - 1)[None], delta, gate, round_once=True
        )
        assert torch.equal(total, summed.view(6, width))
        torch.testing.assert_close(got, want.view(6, width), rtol=0, atol=2**-7 * want.abs().max())


def test_kernel_agrees_with_the_reference(interpret):
    """Triton's interpreter rounds float32 to bfloat16 towards zero (the GPU to nearest), so
    interpreted bf16 results may sit a few steps off."""
    found = cases()
    for case, got in zip(found, interpret(run_kernel, found), strict=True):
        assert_agree(got, ada_norm.reference(**case), steps=4)


def test_shapes_are_checked():
    x, mods = torch.zeros(6, 8), torch.zeros(4, 8)
    with pytest.raises(ada_norm.AdaNormError, match="must divide"):
        ada_norm.ada_norm(x, mods, mods)
    with pytest.raises(ada_norm.AdaNormError, match="together"):
        ada_norm.ada_norm(x, mods[:2], mods[:2], delta=x)
    with pytest.raises(ada_norm.AdaNormError, match="views of one stride"):
        ada_norm.ada_norm(x, mods[:2], torch.zeros(2, 5))


@pytest.mark.gpu
def test_kernel_agrees_with_the_reference_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for case in cases():
        on = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
        assert_agree(ada_norm.ada_norm(**on), ada_norm.reference(**on), steps=2)
