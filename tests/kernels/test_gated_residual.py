"""A DiT block's last gated residual add (`ada_norm.gated_residual`): its reference is
diffusers' ops (Wan2.2's block in float32 rounded once, Qwen-Image's in the input dtype), and
its Triton kernel, ada_norm's with the norm off (interpreted on the CPU, compiled on a GPU),
agrees with the reference."""

import pytest
import torch

from omniflow.kernels import ada_norm as kernel

# (gate rows, rows each, width): a gate per request, per token; widths below, not divisible
# by, at and over a block.
SHAPES = [(2, 3, 64), (1, 5, 100), (3, 1, 1024), (2, 2, 2500)]


def cases() -> list[dict]:
    found = []
    g = torch.Generator().manual_seed(0)
    for gates, per, width in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(gates * per, width, generator=g) * 3).to(dtype)
            delta = torch.randn(gates * per, width, generator=g).to(dtype)
            # the gate a strided chunk of an adaLN product, as the blocks' are
            chunk = torch.randn(gates, 3 * width, generator=g).chunk(3, dim=1)[1]
            found.append({"x": x, "delta": delta, "gate": chunk.to(dtype)})  # Qwen-Image's
            found.append({"x": x, "delta": delta, "gate": chunk, "round_once": True})  # Wan's
    return found


def run_kernel(found: list[dict]) -> list[torch.Tensor]:
    """Runs under TRITON_INTERPRET=1."""
    return [kernel.gated_residual_triton(**case) for case in found]


def assert_agree(got, found: list[dict]) -> None:
    """Within a step of the dtype at the largest input's magnitude for each of the two
    roundings (the interpreter rounds bf16 its own way; compiled, a multiply-add may be
    contracted; a step of `gate * delta` survives the add where it cancels)."""
    for out, case in zip(got, found, strict=True):
        want = kernel.gated_residual_reference(**case)
        assert out.dtype == want.dtype and out.shape == want.shape
        step = 1e-6 if want.dtype == torch.float32 else 2**-7
        largest = max(case["x"].abs().max(), (case["delta"].abs().max() * case["gate"].abs().max()))
        torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=2 * step * largest)


def test_the_reference_is_the_blocks_ops():
    x, delta = torch.randn(6, 8).bfloat16(), torch.randn(6, 8).bfloat16()
    gate = torch.randn(2, 8)
    rows = gate.repeat_interleave(3, 0)
    wan = kernel.gated_residual_reference(x, delta, gate, round_once=True)
    assert torch.equal(wan, (x.float() + delta.float() * rows).type_as(x))
    qwen = kernel.gated_residual_reference(x, delta, gate.bfloat16())
    assert torch.equal(qwen, x + rows.bfloat16() * delta)


def test_kernel_agrees_with_the_reference(interpret):
    found = cases()
    assert_agree(interpret(run_kernel, found), found)


def test_shapes_are_checked():
    x = torch.zeros(4, 8)
    with pytest.raises(kernel.AdaNormError, match="3 gate rows for 4 rows"):
        kernel.gated_residual_reference(x, x, torch.zeros(3, 8))
    with pytest.raises(kernel.AdaNormError, match="is not x's"):
        kernel.gated_residual_reference(x, torch.zeros(4, 9), torch.zeros(1, 8))
    with pytest.raises(kernel.AdaNormError, match="contiguous rows"):
        kernel.gated_residual_reference(x, x, torch.zeros(8, 2).t())


@pytest.mark.gpu
def test_kernel_agrees_with_the_reference_on_gpu(on_cuda):
    found = [dict(zip(case, on_cuda(case.values()), strict=True)) for case in cases()]
    assert_agree(run_kernel(found), found)
