"""Qwen-Image's blocks on fused kernels (`omniflow.families.qwen_image.fused_blocks`) compute
what diffusers' `QwenImageTransformerBlock`s compute: on the CPU with the kernels' torch
references (float32: identical on 2 CPU cores; the bound leaves room for the stacked q/k/v
product's reordering), on a GPU with the Triton kernels in bf16 (a few bf16 steps of the
output's rms)."""

import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

from omniflow.backends.dit_blocks import feed_forward, modules_forward
from omniflow.checkpoints.tiny import build_tiny
from omniflow.families.qwen_image.fused_blocks import (
    FusedQwenImageBlock,
    fuse_blocks,
    text_seq_len_from_mask,
)

torch.set_num_threads(1)


def block_inputs(block: QwenImageTransformerBlock, batch: int, image: int, text: int, device):
    g = torch.Generator().manual_seed(2)
    width, half = block.dim, block.attention_head_dim // 2

    def freqs(tokens: int) -> torch.Tensor:
        angles = torch.rand(tokens, half, generator=g) * 6
        return torch.polar(torch.ones_like(angles), angles).to(device)

    dtype = block.img_mod[1].weight.dtype
    return {
        "hidden_states": torch.randn(batch, image, width, generator=g).to(device, dtype),
        "encoder_hidden_states": torch.randn(batch, text, width, generator=g).to(device, dtype),
        "temb": torch.randn(batch, width, generator=g).to(device, dtype),
        "image_rotary_emb": (freqs(image), freqs(text)),
    }


def random_block(dtype: torch.dtype, device: str) -> QwenImageTransformerBlock:
    torch.manual_seed(0)
    block = QwenImageTransformerBlock(dim=48, num_attention_heads=3, attention_head_dim=16)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "norm" in name:  # the q/k RMSNorms start at ones
                p.uniform_(0.5, 1.5)
    return block.to(device, dtype).eval()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().pow(2).mean().sqrt())


@pytest.mark.parametrize("masked", [False, True])
def test_a_fused_block_is_the_modules_block(masked):
    block = random_block(torch.float32, "cpu")
    inputs = block_inputs(block, batch=2, image=37, text=5, device="cpu")
    mask = None
    if masked:  # the second row's prompt is two tokens shorter
        mask = torch.ones(2, 5, dtype=torch.bool)
        mask[1, 3:] = False
    with torch.no_grad():
        want = block(encoder_hidden_states_mask=mask, **inputs)
        got = FusedQwenImageBlock(block)(encoder_hidden_states_mask=mask, **inputs)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert relative(a, b) < 1e-5


def test_a_float16_block_runs_diffusers_forward():
    """diffusers clips a float16 block's outputs to float16's range; the fused path does not,
    so such a block keeps diffusers' forward (which calls the attention module; the fused
    path calls only its projections)."""
    calls = []
    for dtype, expected in ((torch.float32, 0), (torch.float16, 1)):
        block = random_block(dtype, "cpu")
        block.attn.register_forward_hook(lambda *_: calls.append(None))
        inputs = block_inputs(block, batch=1, image=9, text=3, device="cpu")
        with torch.no_grad():
            want = block(encoder_hidden_states_mask=None, **inputs)
            calls.clear()
            got = FusedQwenImageBlock(block)(encoder_hidden_states_mask=None, **inputs)
        assert len(calls) == expected
        for a, b in zip(got, want, strict=True):
            assert relative(a, b) < 1e-5


def test_the_transformer_with_fused_blocks_gives_its_own_output():
    """The tiny checkpoint's transformer, its blocks fused, then within `modules_forward`."""
    transformer = QwenImageTransformer2DModel.from_pretrained(
        build_tiny("text-to-image"), subfolder="transformer"
    ).eval()
    g = torch.Generator().manual_seed(4)
    side = 6
    inputs = {
        "hidden_states": torch.randn(2, side * side, transformer.config.in_channels, generator=g),
        "encoder_hidden_states": torch.randn(
            2, 7, transformer.config.joint_attention_dim, generator=g
        ),
        "timestep": torch.tensor([0.3, 0.7]),
        "img_shapes": [[(1, side, side)]] * 2,
        "return_dict": False,
    }
    fuse_blocks(transformer)
    fused, modules = both_ways(transformer, transformer.transformer_blocks, inputs)
    assert relative(fused, modules) < 1e-5


def test_the_masks_length_without_a_host_copy_is_diffusers():
    """What `fuse_blocks` puts in place of diffusers' mask normalisation gives what diffusers'
    gives (the text's length; each row's up to its last real token, the whole length for a
    row of padding only; the mask as bools): rows padded, all padding, none padded."""
    text = torch.randn(3, 7, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0], [0] * 7, [1] * 7])
    length, rows, bools = text_seq_len_from_mask(text, mask)
    assert length == 7 and rows.tolist() == [3, 7, 7]
    assert torch.equal(bools, mask.bool())
    assert text_seq_len_from_mask(text, None) == (7, None, None)
    with pytest.raises(ValueError, match="must match"):
        text_seq_len_from_mask(text, mask[:2])


def both_ways(transformer, blocks, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """`transformer`'s output with its `blocks` fused (as they are), then within
    `modules_forward` (diffusers' blocks), and the blocks fused again after."""
    fused_type = type(blocks[0].forward)
    assert all(type(b.forward) is fused_type for b in blocks) and "forward" in vars(blocks[0])
    with torch.no_grad():
        (fused,) = transformer(**inputs)
        with modules_forward(blocks):
            assert not any("forward" in vars(b) for b in blocks)
            (modules,) = transformer(**inputs)
    assert all(type(b.forward) is fused_type for b in blocks)
    return fused, modules


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_bf16_fused_block_is_the_modules_block(device):
    """In bf16 at a real image's token count: on the CPU the kernels' torch references, on a
    GPU the Triton kernels."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    block = random_block(torch.bfloat16, device)
    inputs = block_inputs(block, batch=2, image=300, text=11, device=device)
    with torch.no_grad():
        want = block(encoder_hidden_states_mask=None, **inputs)
        got = FusedQwenImageBlock(block)(encoder_hidden_states_mask=None, **inputs)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert relative(a, b) < 2**-5


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_mlp_with_its_gelu_in_the_epilogue_is_the_modules(device):
    """`feed_forward`: on the CPU the module's own forward; on a GPU the first product's
    epilogue applies the tanh GELU, within bf16 steps of the module's (which rounds the
    product to bf16 before its GELU)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    block = random_block(torch.bfloat16, device)
    x = torch.randn(300, block.dim, generator=torch.Generator().manual_seed(3))
    x = x.to(device, torch.bfloat16)
    with torch.no_grad():
        got, want = feed_forward(block.img_mlp, x), block.img_mlp(x)
    if device == "cpu":
        assert torch.equal(got, want)
    else:
        assert got.shape == want.shape and relative(got, want) < 2**-5
