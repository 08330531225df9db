"""Wan2.2's blocks on fused kernels (`omniflow.families.wan.fused_blocks`) compute what
diffusers' `WanTransformerBlock`s compute, for the A14B's blocks (one modulation per batch
row) and TI2V-5B's (per token): here on the CPU with the kernels' torch references (float32:
the stacked products' reordering, ~1e-6 of the output's rms; bf16: the references round
where Wan rounds, measured identical), the whole tiny transformers against their own
forward, and the diffusion stage with `blocks="fused"` against `WanPipeline.__call__`.
tests/kernels/test_fused_dit_blocks.py runs the same blocks through the Triton kernels
under Triton's interpreter."""

import logging

import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed, WanTransformerBlock

from omniflow.backends.dit_blocks import (
    Attention,
    AttentionError,
    attention_for,
    fastest,
    refusal,
)
from omniflow.checkpoints.tiny import build_tiny
from omniflow.compiler import compile_source
from omniflow.families.wan.fused_blocks import FusedWanBlock, fuse_blocks
from omniflow.runtime.interpreter import Interpreter
from tests.backends.test_diffusion import Stages
from tests.backends.test_qwen_image_fused import both_ways
from tests.families.test_wan import SMALL, T2V, denoise, load, reference

torch.set_num_threads(1)

WIDTH, HEADS, TEXT = 64, 4, 7
STYLES = ("a14b", "ti2v")  # one modulation per batch row; one per token


def random_block(dtype: torch.dtype, image_context: bool = False) -> WanTransformerBlock:
    """A Wan2.2 block (`cross_attn_norm`, `rms_norm_across_heads`), its norms' weights drawn
    away from ones; `image_context`: Wan2.1 I2V's added key/value projections."""
    torch.manual_seed(0)
    block = WanTransformerBlock(
        dim=WIDTH, ffn_dim=2 * WIDTH, num_heads=HEADS, qk_norm="rms_norm_across_heads",
        cross_attn_norm=True, eps=1e-6, added_kv_proj_dim=WIDTH if image_context else None,
    )  # fmt: skip
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return block.to(dtype).eval()


def block_inputs(style: str, dtype: torch.dtype, batch: int = 2, grid=(3, 4, 6)) -> tuple:
    """(hidden, text, temb, rotary) as `WanTransformer3DModel.forward` hands them to a block:
    the rotary of a `grid` (frames, height, width) of patches, float32."""
    g = torch.Generator().manual_seed(1)
    frames, height, width = grid
    tokens = frames * height * width
    rope = WanRotaryPosEmbed(WIDTH // HEADS, (1, 2, 2), 1024)
    cos, sin = rope(torch.zeros(batch, 1, frames, 2 * height, 2 * width))
    temb_shape = (batch, tokens, 6, WIDTH) if style == "ti2v" else (batch, 6, WIDTH)
    return (
        torch.randn(batch, tokens, WIDTH, generator=g).to(dtype),
        torch.randn(batch, TEXT, WIDTH, generator=g).to(dtype),
        torch.randn(*temb_shape, generator=g).to(dtype),
        (cos.float(), sin.float()),
    )


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference over `b`'s rms."""
    return float((a.float() - b.float()).abs().max() / b.float().pow(2).mean().sqrt())


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within four bf16 steps at the output's largest magnitude, and 2^-6 of its rms overall
    (Triton's kernels sum in other orders: a step here and there, carried through a block)."""
    diff = (got.float() - want.float()).abs()
    assert diff.max() <= 4 * 2**-7 * want.float().abs().max()
    assert diff.pow(2).mean().sqrt() <= 2**-6 * want.float().pow(2).mean().sqrt()


def fused_and_modules(style: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    block = random_block(dtype)
    inputs = block_inputs(style, dtype)
    with torch.no_grad():
        return FusedWanBlock(block)(*inputs), block(*inputs)


def transformer_inputs(transformer: WanTransformer3DModel, style: str) -> dict:
    """A guided pair's forward at 3 latent frames of 8 x 12 (3 x 4 x 6 patches)."""
    g = torch.Generator().manual_seed(4)
    config = transformer.config
    shape = (2, config.in_channels, 3, 8, 12)
    timestep = torch.tensor([300.0, 700.0])
    if style == "ti2v":  # per token, the first frame's at 0 (an image-to-video request's)
        timestep = timestep[:, None].repeat(1, 3 * 4 * 6)
        timestep[:, : 4 * 6] = 0
    return {
        "hidden_states": torch.randn(shape, generator=g),
        "timestep": timestep,
        "encoder_hidden_states": torch.randn(2, TEXT, config.text_dim, generator=g),
        "return_dict": False,
    }


def tiny_transformer(style: str) -> WanTransformer3DModel:
    name = "wan2.2-ti2v" if style == "ti2v" else "wan2.2-t2v"
    return WanTransformer3DModel.from_pretrained(build_tiny(name), subfolder="transformer").eval()


def fused_and_own_forward(style: str) -> tuple[torch.Tensor, torch.Tensor]:
    transformer = tiny_transformer(style)
    inputs = transformer_inputs(transformer, style)
    fuse_blocks(transformer)
    assert all(isinstance(b.forward, FusedWanBlock) for b in transformer.blocks)
    return both_ways(transformer, transformer.blocks, inputs)


@pytest.mark.parametrize("style", STYLES)
def test_a_fused_block_is_the_modules_block(style):
    got, want = fused_and_modules(style, torch.float32)
    assert got.shape == want.shape
    assert relative(got, want) < 1e-5


@pytest.mark.parametrize("style", STYLES)
def test_a_bf16_fused_block_is_the_modules_block(style):
    got, want = fused_and_modules(style, torch.bfloat16)
    assert got.dtype == want.dtype == torch.bfloat16
    assert_bf16_close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("style", STYLES)
def test_a_bf16_fused_block_on_the_gpu_is_the_modules_block(style):
    """The compiled kernels, at a few hundred tokens, each attention kernel that runs here
    (`auto`'s candidates) in turn."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    block = random_block(torch.bfloat16).cuda()
    hidden, text, temb, (cos, sin) = block_inputs(style, torch.bfloat16, grid=(3, 8, 12))
    args = (hidden.cuda(), text.cuda(), temb.cuda(), (cos.cuda(), sin.cuda()))
    times = fastest(HEADS, WIDTH // HEADS, torch.bfloat16, "cuda")
    assert "sdpa" in times
    with torch.no_grad():
        want = block(*args)
        for kernel in times:
            assert_bf16_close(FusedWanBlock(block, Attention(kernel))(*args), want)


def test_a_block_with_an_image_context_runs_diffusers_forward():
    """Wan2.1 I2V's blocks attend to image tokens too: not the fused computation, so diffusers'
    forward runs (the fused path never calls the attention modules)."""
    calls = []
    for image_context, expected in ((False, 0), (True, 2)):
        block = random_block(torch.float32, image_context)
        for attn in (block.attn1, block.attn2):
            attn.register_forward_hook(lambda *_: calls.append(None))
        hidden, text, temb, rotary = block_inputs("a14b", torch.float32)
        if image_context:  # 257 image tokens before the 512 text rows diffusers assumes
            text = torch.randn(2, 257 + 512, WIDTH)
        with torch.no_grad():
            want = block(hidden, text, temb, rotary)
            calls.clear()
            got = FusedWanBlock(block)(hidden, text, temb, rotary)
        assert len(calls) == expected
        assert relative(got, want) < 1e-5


@pytest.mark.parametrize("style", STYLES)
def test_the_transformer_with_fused_blocks_gives_its_own_output(style):
    fused, own = fused_and_own_forward(style)
    assert fused.shape == own.shape
    assert relative(fused, own) < 1e-5


def test_an_attention_kernel_that_cannot_run_is_named():
    """Forced SDPA backends run where torch has them (math everywhere); flash-attn is not
    installed on the CPU machines."""
    q = torch.randn(1, 5, 2, 8)
    want = Attention("sdpa")(q, q, q)
    torch.testing.assert_close(Attention("math")(q, q, q), want)
    with pytest.raises(AttentionError, match="flash_attn"):
        Attention("flash_attn")
    with pytest.raises(AttentionError, match="one of auto, sdpa"):
        Attention("fastest")
    # A named kernel is probed at load: cuDNN's has no CPU kernel.
    with pytest.raises(AttentionError, match="'cudnn' does not run here"):
        attention_for("cudnn", 2, 8, torch.float32, "cpu")
    assert attention_for("auto", 2, 8, torch.float32, "cpu").kernel == "sdpa"


def test_a_forced_kernel_that_refuses_a_calls_shapes_leaves_them_to_sdpa(caplog):
    """A kernel is chosen (`auto`) or probed at load at other shapes than a request's (a
    cross-attention's 512 text keys under 32k video queries): where the forced SDPA backend
    refuses a call, torch's own choice runs it, said once a shape, never a failed request.
    cuDNN's backend refuses every CPU call; the probe still names it."""
    q, k = torch.randn(1, 6, 2, 8), torch.randn(1, 3, 2, 8)
    attend = Attention("cudnn")
    with caplog.at_level(logging.WARNING, logger="omniflow.backends.dit_blocks"):
        outs = [attend(q, k, k), attend(q, k, k), attend(q, q, q)]
    torch.testing.assert_close(outs[0], Attention("sdpa")(q, k, k))
    torch.testing.assert_close(outs[2], Attention("sdpa")(q, q, q))
    refusals = [r for r in caplog.records if "refuses" in r.getMessage()]
    assert len(refusals) == 2 and "[1, 2, 6, 8]" in refusals[0].getMessage()
    assert refusal("cudnn", q) is not None
    with pytest.raises(RuntimeError):
        Attention("cudnn", fall_back=False)(q, k, k)


def test_the_stage_with_fused_blocks_matches_the_pipeline():
    """`blocks="fused"` on the CPU: the diffusion stage's experts forward on the fused blocks
    (the kernels' references) and a guided request across the boundary gives the latents
    `WanPipeline.__call__` gives."""
    text = T2V.read_text(encoding="utf-8")
    old = "cache_threshold=$cache_threshold)"
    assert old in text
    text = text.replace(old, 'cache_threshold=$cache_threshold, blocks="fused")')
    text = text.replace("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "tiny:wan2.2-t2v")
    stages = Stages(Interpreter(compile_source(text, devices="cpu")))
    pipe = stages.backends["dit"].pipe
    for part in ("transformer", "transformer_2"):
        assert all(isinstance(b.forward, FusedWanBlock) for b in getattr(pipe, part).blocks)
    assert stages.backends["dit"].attention.kernel == "sdpa"  # "auto" off CUDA
    inputs = {"prompt": "A cat walks on the grass", "negative_prompt": "blurry"}
    params = {**SMALL, "guidance_scale": 4.0, "guidance_scale_2": 3.0}
    got = denoise(stages, {"a": (inputs, params)}, [["a"]] * SMALL["steps"])["a"]
    want = reference(load("wan2.2-t2v"), inputs, params, guidance_scale=4.0, guidance_scale_2=3.0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
