"""The fused DiT blocks through their Triton kernels, on the CPU under Triton's interpreter
(the dispatchers run the kernels there, `omniflow.kernels.triton_guard.on_triton`): Wan2.2's
blocks (A14B-style and TI2V-5B-style modulation) against diffusers' `WanTransformerBlock`
in float32 and bf16, the tiny Wan2.2 transformers' whole forward on fused blocks against
their own, and Qwen-Image's block against diffusers' `QwenImageTransformerBlock`.

Tolerances: float32 1e-5 of the output's rms (measured ~1e-6); bf16 a few steps
(`assert_bf16_close`: the kernels sum in other orders than torch, and the interpreter's
bf16 steps carry through a block's products)."""

import pytest
import torch

from omniflow.families.qwen_image.fused_blocks import FusedQwenImageBlock
from omniflow.kernels.triton_guard import on_triton
from tests.backends import test_qwen_image_fused as qwen
from tests.backends.test_wan_fused import (
    STYLES,
    assert_bf16_close,
    fused_and_modules,
    fused_and_own_forward,
    relative,
)


def run_blocks(model: str) -> dict:
    """Runs under TRITON_INTERPRET=1: `model`'s blocks, fused and not (a Wan modulation
    style's blocks and whole transformer, or "qwen": Qwen-Image's text and image streams)."""
    torch.set_num_threads(1)
    out = {"interpreted": on_triton(torch.zeros(1))}
    if model in STYLES:
        for dtype in (torch.float32, torch.bfloat16):
            out[model, str(dtype)] = fused_and_modules(model, dtype)
        out[model, "transformer"] = fused_and_own_forward(model)
    for dtype in (torch.float32, torch.bfloat16) if model == "qwen" else ():
        block = qwen.random_block(dtype, "cpu")
        inputs = qwen.block_inputs(block, batch=2, image=24, text=5, device="cpu")
        with torch.no_grad():
            want = block(encoder_hidden_states_mask=None, **inputs)
            got = FusedQwenImageBlock(block)(encoder_hidden_states_mask=None, **inputs)
        out["qwen", str(dtype)] = list(zip(got, want, strict=True))  # text, image streams
    return out


MODELS = [*((style, 3) for style in STYLES), ("qwen", 2)]


# A job per model: all in one took ~22 s of the interpreter's limit (then 120 s) on an idle 2-core
# machine, both Wan styles in one ~19 s (kernels/conftest.py). They start together as the file
# begins, and run side by side.
@pytest.fixture(scope="module", autouse=True)
def _jobs_ahead(interpret_ahead, request):
    jobs = [(run_blocks, model) for model, _ in MODELS]
    interpret_ahead(request, {test_the_fused_blocks_on_the_kernels_are_diffusers_blocks: jobs})


@pytest.mark.parametrize("model, cases", MODELS)
def test_the_fused_blocks_on_the_kernels_are_diffusers_blocks(interpret, model, cases):
    out = interpret(run_blocks, model)
    assert out.pop("interpreted") is True and len(out) == cases
    for (name, what), pairs in out.items():
        pairs = pairs if name == "qwen" else [pairs]
        for got, want in pairs:
            assert got.shape == want.shape, (name, what)
            if what == str(torch.bfloat16):
                assert_bf16_close(got, want)
            else:
                assert relative(got, want) < 1e-5, (name, what)
