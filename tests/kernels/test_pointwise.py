"""The fused pointwise kernel computes what the op-by-op reference computes."""

import ast

import pytest
import torch

from omniflow.kernels.pointwise import chain_expression, fused, reference, triton_source
from omniflow.kernels.pointwise_ops import OPS, chain_out_dtype

ARGS = {"gain": (0.9,), "offset": (-0.25,), "clamp": (-0.5, 0.75)}
CHAINS = [
    (("gain", (0.9,)), ("clamp", (-1, 1)), ("pcm16", ())),
    (("denorm", ()), ("to_uint8", ())),
    tuple((name, ARGS.get(name, ())) for name in OPS if name not in ("pcm16", "to_uint8")),
    (("tanh", ()), ("sigmoid", ()), ("offset", (1.5,)), ("abs", ()), ("relu", ())),
]


def _input(device="cpu"):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(4099, generator=g) * 2).to(device)


@pytest.mark.parametrize("name", sorted(OPS))
def test_each_op_matches_its_meaning(name):
    x = _input()
    want = {
        "gain": x * 0.9,
        "offset": x - 0.25,
        "clamp": x.clamp(-0.5, 0.75),
        "abs": x.abs(),
        "relu": x.relu(),
        "sigmoid": torch.sigmoid(x),
        "tanh": torch.tanh(x),
        "denorm": (x + 1) / 2,
        "pcm16": torch.floor(x.clamp(-1, 1) * 32767 + 0.5).to(torch.int16),
        "to_uint8": torch.floor(x.clamp(0, 1) * 255 + 0.5).to(torch.uint8),
    }[name]
    got = fused(x, ((name, ARGS.get(name, ())),))
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: "|".join(n for n, _ in c))
def test_fused_chain_equals_op_by_op_reference(chain):
    x = _input()
    got, want = fused(x, chain), reference(x, chain)
    assert got.dtype == want.dtype == getattr(torch, chain_out_dtype("float32", list(chain)))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_expression_inlines_arguments_and_nests_ops():
    chain = (("gain", (2,)), ("clamp", (-1, 1)))
    assert chain_expression(chain) == "minimum(maximum(x * 2.0, -1.0), 1.0)"
    assert chain_expression(chain, "tl") == "tl.minimum(tl.maximum(x * 2.0, -1.0), 1.0)"


def test_generated_triton_source_is_valid_python():
    source = triton_source(CHAINS[0], "int16")
    ast.parse(source)
    assert "y.to(tl.int16)" in source and "@triton.jit" in source


@pytest.mark.gpu
@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: "|".join(n for n, _ in c))
def test_triton_kernel_matches_reference_on_gpu(chain):
    x = _input("cuda")
    got, want = fused(x, chain), reference(x, chain)
    assert got.dtype == want.dtype
    # Integer outputs may differ by one step where the GPU contracts a*b+c into an FMA.
    tol = 1 if not got.dtype.is_floating_point else 1e-5
    assert (got.double() - want.double()).abs().max().item() <= tol
