"""The fused residual add + RMSNorm: its reference is HF's RMSNorm module op by op, and its
Triton kernel (interpreted on the CPU, compiled on a GPU) agrees with the reference."""

import pytest
import torch

from omniflow.kernels import rms_norm

# (rows, width): widths below, not divisible by, and above one power-of-two block.
SHAPES = [(1, 64), (3, 100), (5, 896), (2, 3584)]


def cases() -> list[dict]:
    found = []
    g = torch.Generator().manual_seed(0)
    for rows, width in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(rows, width, generator=g) * 3).to(dtype)
            residual = torch.randn(rows, width, generator=g).to(dtype)
            weight = (1 + torch.randn(width, generator=g) / 4).to(dtype)
            found.append({"x": x, "residual": residual, "weight": weight, "eps": 1e-6})
            found.append({"x": x, "residual": None, "weight": weight, "eps": 1e-5})
    return found


def run_kernel(found: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Runs under TRITON_INTERPRET=1."""
    return [rms_norm.add_rms_norm_triton(**case) for case in found]


def assert_agree(got, want, steps: int = 1) -> None:
    """Within `steps` steps of the output dtype (float32: rounding)."""
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        tol = 1e-6 if a.dtype == torch.float32 else steps * 2**-7
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def test_the_reference_is_hf_rmsnorm():
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    for case in cases():
        norm = Qwen2RMSNorm(case["x"].shape[1], eps=case["eps"]).to(case["x"].dtype)
        norm.weight.data.copy_(case["weight"])
        total = case["x"] if case["residual"] is None else case["x"] + case["residual"]
        out, summed = rms_norm.reference(**case)
        assert torch.equal(summed, total)
        assert torch.equal(out, norm(total))


def test_kernel_agrees_with_the_reference(interpret):
    """Triton's interpreter rounds float32 to bfloat16 towards zero (the GPU rounds to
    nearest, as torch does), so interpreted bf16 results may sit a few steps off."""
    found = cases()
    for case, got in zip(found, interpret(run_kernel, found), strict=True):
        want = rms_norm.reference(**case)
        if case["x"].dtype == torch.float32:
            assert torch.equal(got[1], want[1])  # the sum: one rounding, as torch's add
        assert_agree(got, want, steps=4)


def partial_cases() -> list[dict]:
    """Residuals as partials: a split product's float32 `[S, B, H]`, and a MoE layer's k
    weighted outputs in x's dtype, `[B, k, H]` seen as `[k, B, H]` (strided)."""
    g = torch.Generator().manual_seed(1)
    found = []
    for rows, width in SHAPES[:3]:
        for dtype, parts in ((torch.float32, 5), (torch.bfloat16, 8)):
            x = (torch.randn(rows, width, generator=g) * 3).to(dtype)
            weight = (1 + torch.randn(width, generator=g) / 4).to(dtype)
            split = torch.randn(parts, rows, width, generator=g)
            moe = torch.randn(rows, parts, width, generator=g).to(dtype).transpose(0, 1)
            for residual in (split, moe):
                found.append({"x": x, "residual": residual, "weight": weight, "eps": 1e-6})
    return found


def test_partial_sums_are_added_as_the_reference_adds_them(interpret):
    found = partial_cases()
    for case, got in zip(found, interpret(run_kernel, found), strict=True):
        want = rms_norm.reference(**case)
        summed = case["residual"].sum(0).to(case["x"].dtype)
        assert torch.equal(want[1], case["x"] + summed)
        assert_agree(got, want, steps=4)


def test_shapes_are_checked():
    with pytest.raises(rms_norm.NormError):
        rms_norm.add_rms_norm(torch.zeros(2, 4), None, torch.ones(5), 1e-6)


@pytest.mark.gpu
def test_kernel_agrees_with_the_reference_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for case in cases():
        on = {k: v.cuda() if torch.is_tensor(v) else v for k, v in case.items()}
        got, want = rms_norm.add_rms_norm(**on), rms_norm.reference(**on)
        assert torch.equal(got[1], want[1])
        assert_agree(got, want)
    for case in partial_cases():  # (sums of partials in another order: a step apart at most)
        on = {k: v.cuda() if torch.is_tensor(v) else v for k, v in case.items()}
        assert_agree(rms_norm.add_rms_norm(**on), rms_norm.reference(**on))
