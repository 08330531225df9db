"""Products of a few rows by a weight: plain (with and without bias), gated (SwiGLU's
`silu(gate) * up` on the products) and split into float32 partial sums. The Triton kernel
(interpreted on the CPU, compiled on a GPU) agrees with torch's `F.linear`."""

import pytest
import torch

from omniflow.kernels import rms_norm, skinny_matmul

# (rows, columns, depth): rows from one to ROWS, sizes not divisible by the blocks, a depth
# of several K tiles.
SHAPES = [(1, 40, 50), (5, 100, 300), (16, 33, 17), (3, 70, 530)]


def cases() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    found = []
    for rows, columns, depth in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, depth, generator=g).to(dtype)
            weight = (torch.randn(2 * columns, depth, generator=g) / depth**0.5).to(dtype)
            bias = torch.randn(2 * columns, generator=g).to(dtype)
            found.append({"x": x, "weight": weight, "bias": bias})
            found.append({"x": x, "weight": weight[:columns], "bias": None})
            found.append({"x": x, "weight": weight, "bias": None, "gated": True})
    return found


def split_cases() -> list[dict]:
    """Plain cases cut into slices of 16 columns of K, as many as the depth allows."""
    return [
        {**case, "splits": 4, "block_k": 16}
        for case in cases()
        if not case.get("gated") and case["x"].shape[1] > 16
    ]


def run_kernel(found: list[dict]) -> list[torch.Tensor]:
    """Runs under TRITON_INTERPRET=1."""
    return [skinny_matmul.skinny_matmul_triton(**case) for case in found]


def want(case: dict) -> torch.Tensor:
    kept = {k: v for k, v in case.items() if k not in ("splits", "block_k")}
    return skinny_matmul.reference(**kept)


def assert_agree(got: torch.Tensor, expected: torch.Tensor, steps: int) -> None:
    """Within `steps` steps of bfloat16 relative to the largest value; float32 to rounding
    of sums in another order."""
    assert got.shape == expected.shape
    scale = expected.abs().max().item()
    tol = 1e-5 if expected.dtype == torch.float32 else steps * 2**-7
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol * scale)


def test_kernel_agrees_with_torch(interpret):
    """Triton's interpreter rounds float32 to bfloat16 towards zero (the GPU rounds to
    nearest), so interpreted bf16 results may sit a few steps off."""
    found = cases() + split_cases()
    for case, got in zip(found, interpret(run_kernel, found), strict=True):
        expected = want(case)
        assert got.dtype == (torch.float32 if "splits" in case else expected.dtype)
        if "splits" in case:
            assert got.shape[0] == min(4, -(-case["x"].shape[1] // 16))  # none empty
            got = got.sum(0)
        assert_agree(got, expected, steps=4)


def run_norm(found: list[tuple]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Runs under TRITON_INTERPRET=1: a split product's partial sums as a norm's residual."""
    out = []
    for case, hidden, weight in found:
        parts = skinny_matmul.skinny_matmul_triton(**case)
        out.append((parts, *rms_norm.add_rms_norm_triton(hidden, parts, weight, 1e-6)))
    return out


def test_the_norm_adds_up_a_split_products_partial_sums(interpret):
    g = torch.Generator().manual_seed(1)
    found = []
    for case in split_cases():
        rows, columns = case["x"].shape[0], case["weight"].shape[0]
        hidden = torch.randn(rows, columns, generator=g).to(case["x"].dtype)
        weight = torch.randn(columns, generator=g).to(case["x"].dtype)
        found.append((case, hidden, weight))
    results = interpret(run_norm, found)
    for (_, hidden, weight), (parts, out, total) in zip(found, results, strict=True):
        want_out, want_total = rms_norm.reference(hidden, parts, weight, 1e-6)
        tol = 1e-6 if total.dtype == torch.float32 else 2**-5  # bf16: the interpreter's rounding
        torch.testing.assert_close(total.float(), want_total.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(out.float(), want_out.float(), rtol=tol, atol=tol)


def test_operands_are_checked():
    x, weight = torch.zeros(2, 8), torch.zeros(6, 8)
    with pytest.raises(skinny_matmul.SkinnyMatmulError, match="do not chain"):
        skinny_matmul.reference(x, weight[:, :4])
    with pytest.raises(skinny_matmul.SkinnyMatmulError, match="gated"):
        skinny_matmul.reference(x, weight[:5], gated=True)
    with pytest.raises(skinny_matmul.SkinnyMatmulError, match="bias"):
        skinny_matmul.reference(x, weight, torch.zeros(5))
    with pytest.raises(skinny_matmul.SkinnyMatmulError, match="at most"):
        skinny_matmul.skinny_matmul_triton(torch.zeros(17, 8), weight)
    with pytest.raises(skinny_matmul.SkinnyMatmulError, match="splits"):
        skinny_matmul.skinny_matmul_triton(x, weight, gated=True, splits=2)


@pytest.mark.gpu
def test_kernel_agrees_with_torch_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for case in cases() + split_cases():
        on = {k: v.cuda() if torch.is_tensor(v) else v for k, v in case.items()}
        got = skinny_matmul.skinny_matmul_triton(**on)
        assert_agree(got.sum(0) if "splits" in on else got, want(on), steps=2)


@pytest.mark.gpu
def test_the_norm_adds_up_partial_sums_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for case in split_cases():
        on = {k: v.cuda() if torch.is_tensor(v) else v for k, v in case.items()}
        parts = skinny_matmul.skinny_matmul_triton(**on)
        hidden = torch.randn(parts.shape[1:], device="cuda").to(on["x"].dtype)
        weight = torch.randn(parts.shape[-1], device="cuda").to(on["x"].dtype)
        out, total = rms_norm.add_rms_norm_triton(hidden, parts, weight, 1e-6)
        want_out, want_total = rms_norm.reference(hidden, parts, weight, 1e-6)
        tol = 1e-6 if out.dtype == torch.float32 else 2**-7  # sums in another order
        torch.testing.assert_close(total.float(), want_total.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(out.float(), want_out.float(), rtol=tol, atol=tol)


def test_the_norm_takes_as_many_partial_sums_as_one_program_holds():
    assert rms_norm.most_parts(896) == rms_norm.most_parts(1024) == 16
    assert rms_norm.most_parts(3584) == 4
    assert rms_norm.most_parts(1 << 20) == 1
    with pytest.raises(rms_norm.NormError, match="at most 4"):
        rms_norm.add_rms_norm_triton(
            torch.zeros(1, 3584), torch.zeros(5, 1, 3584), torch.ones(3584), 1e-6
        )
