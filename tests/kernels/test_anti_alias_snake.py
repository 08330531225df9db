"""The fused anti-aliased SnakeBeta: its reference is transformers' activation module op by
op, and its Triton kernel (interpreted on the CPU, compiled on a GPU) agrees with the
reference, replicate padding at both ends of the signal included."""

import pytest
import torch
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniAntiAliasedActivation1d,
    Qwen2_5OmniSnakeBeta,
)

from omniflow.kernels import anti_alias_snake as aa

# (B, C, T): lengths where the padding is most of the signal (1, 2, 5), lengths within one
# segment (248 outputs at most), across two, just past a program's 992 and across
# several programs; C = 1 and B > 1.
SHAPES = [(1, 1, 1), (1, 1, 2), (2, 3, 5), (1, 4, 100), (1, 3, 300), (1, 2, 993), (2, 1, 3000)]


def activation(channels: int, generator: torch.Generator, **ratios) -> torch.nn.Module:
    """transformers' module with random SnakeBeta parameters (they load as zeros)."""
    module = Qwen2_5OmniAntiAliasedActivation1d(Qwen2_5OmniSnakeBeta(channels), **ratios)
    module.act.alpha.data = torch.randn(channels, generator=generator) / 2
    module.act.beta.data = torch.randn(channels, generator=generator) / 2
    return module


def arguments(module: torch.nn.Module, x: torch.Tensor) -> dict:
    return {
        "x": x,
        "alpha": module.act.alpha.detach(),
        "beta": module.act.beta.detach(),
        "up_filter": module.upsample.filter,
        "down_filter": module.downsample.filter,
    }


def cases() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    found = []
    for batch, channels, length in SHAPES:
        x = torch.randn(batch, channels, length, generator=g) * 2
        found.append(arguments(activation(channels, g), x))
    return found


def run_kernel(found: list[dict]) -> list[torch.Tensor]:
    """Runs under TRITON_INTERPRET=1."""
    return [aa.anti_alias_snake_triton(**case) for case in found]


def test_the_reference_is_transformers_activation():
    g = torch.Generator().manual_seed(1)
    for (batch, channels, length), ratio in [*((shape, 2) for shape in SHAPES), ((2, 3, 40), 3)]:
        module = activation(channels, g, up_ratio=ratio, down_ratio=ratio)
        x = torch.randn(batch, channels, length, generator=g) * 2
        with torch.no_grad():
            want = module(x)
        got = aa.reference(**arguments(module, x), up_ratio=ratio, down_ratio=ratio)
        assert torch.equal(got, want)


def test_kernel_agrees_with_the_reference(interpret):
    found = cases()
    for case, got in zip(found, interpret(run_kernel, found), strict=True):
        want = aa.reference(**case)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_shapes_are_checked():
    module = activation(4, torch.Generator().manual_seed(2))
    good = arguments(module, torch.randn(2, 4, 10))
    bad = [
        {"x": torch.randn(4, 10)},
        {"x": torch.randn(2, 4, 10, dtype=torch.float64)},
        {"x": torch.randn(2, 4, 0)},
        {"alpha": torch.zeros(3)},
        {"down_filter": module.downsample.filter[0]},
    ]
    for change in bad:
        with pytest.raises(aa.AntiAliasError):
            aa.anti_alias_snake(**{**good, **change})
    # Transformers' other settings run in the reference; the kernel refuses them.
    for change in ({"up_filter": torch.ones(1, 1, 8) / 8}, {"up_ratio": 3}):
        with pytest.raises(aa.AntiAliasError, match="12-tap filters and ratio 2"):
            aa.anti_alias_snake_triton(**{**good, **change})


@pytest.mark.gpu
def test_kernel_agrees_with_the_reference_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    # cuDNN would run the reference's convolutions on TF32 tensor cores.
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        for case in cases():
            on = {name: value.cuda() for name, value in case.items()}
            got, want = aa.anti_alias_snake(**on), aa.reference(**on)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
