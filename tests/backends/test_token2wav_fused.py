"""token2wav on fused kernels, as CUDA runs it: the DiT's blocks
(`omniflow.families.qwen2_5_omni.token2wav_dit`) compute what transformers' `DiTDecoderLayer`s and
final norm compute, and BigVGAN with one kernel per anti-aliased activation what its
modules compute: on the CPU with the kernels' torch references, on a GPU with the Triton
kernels. Tolerances: float32, the reorderings of a stacked product and a split norm
(measured on the CPU: ~1e-6 on the tiny model's pass and on a window's audio); bf16, a few
bf16 steps of a pass's output (2^-6 of its rms), and the audio within BF16_RMS_TOLERANCE of
the layers' own bf16 decode. The GPU's float32 bounds (1e-4 of a pass's rms, 1e-3 of
BigVGAN's output) leave room for the kernels' own summation orders and have not yet run."""

import pytest
import torch

from omniflow.catalog.resolve import model_path
from omniflow.families.qwen2_5_omni.token2wav import Token2Wav
from omniflow.families.qwen2_5_omni.token2wav_dit import FusedDiT
from tests.backends.test_token2wav_graphs import (
    BF16_RMS_TOLERANCE,
    relative_rms,
    window_batch,
)

torch.set_num_threads(1)


def decoder_on(device: str, precision: str) -> Token2Wav:
    decoder = Token2Wav(str(model_path("tiny:qwen2.5-omni")), device)
    decoder.set_precision(precision)
    return decoder


def pass_inputs(decoder: Token2Wav, rows: int, length: int):
    """A pass's hidden state, time embedding and rotary, and each position's block (the last
    two padding: a block of their own, as `_solve` lays them out)."""
    g = torch.Generator().manual_seed(3)
    dit, on = decoder.dit, {"device": decoder.device}
    hidden = torch.randn(rows, length, dit.hidden_size, generator=g).to(**on, dtype=decoder.dtype)
    time = torch.rand(1, generator=g).to(**on)
    embedding = dit.time_embed(time.to(decoder.dtype).repeat(rows))
    positions = torch.arange(length, **on)[None].expand(rows, -1)
    rotary = dit.rotary_embed(hidden, positions)
    block = positions.div(decoder.block_size, rounding_mode="floor").clone()
    block[:, -2:] = 1 << 30
    return hidden, embedding, rotary, block


def layers(decoder: Token2Wav, hidden, embedding, rotary, block) -> torch.Tensor:
    dit = decoder.dit
    block_diff = (block[:, None, :] - block[:, :, None])[:, None]
    block_diff = block_diff.expand(-1, dit.num_attention_heads, -1, -1)
    for layer in dit.transformer_blocks:
        hidden = layer(hidden, embedding, position_embeddings=rotary, block_diff=block_diff)
    return dit.norm_out(hidden, embedding)


def fused_and_layers(device: str, precision: str):
    decoder = decoder_on(device, precision)
    fused = FusedDiT(decoder.dit)
    hidden, embedding, rotary, block = pass_inputs(decoder, 4, 53)
    with torch.inference_mode():
        want = layers(decoder, hidden, embedding, rotary, block)
        got = fused(hidden, fused.modulations(embedding[:1]), rotary, block.to(torch.int32))
    return got.float(), want.float()


def test_fused_blocks_compute_the_layers_in_float32():
    got, want = fused_and_layers("cpu", "float32")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_blocks_compute_the_layers_in_bf16():
    got, want = fused_and_layers("cpu", "bfloat16")
    assert relative_rms(got, want) < 2**-6


def test_weights_become_views_of_the_stacked_matrices():
    decoder = decoder_on("cpu", "float32")
    before = {name: p.clone() for name, p in decoder.dit.named_parameters()}
    fused = FusedDiT(decoder.dit)
    for name, p in decoder.dit.named_parameters():
        assert torch.equal(p, before[name]), name
    attn = decoder.dit.transformer_blocks[1].attn
    stacked = fused.qkv[1][0]
    assert attn.to_v.weight.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
    norm = decoder.dit.norm_out.linear
    assert (
        norm.weight.untyped_storage().data_ptr() == fused.modulation[0].untyped_storage().data_ptr()
    )


def test_a_window_decodes_as_with_the_layers():
    """The whole solve with the fused blocks (as CUDA runs it) against transformers' layers
    (as the CPU runs it), in float32."""
    decoder = decoder_on("cpu", "float32")
    windows = window_batch(decoder, 2, 36)
    with torch.inference_mode():
        want = decoder.decode_eager(windows, 36)
        decoder.fused_dit = FusedDiT(decoder.dit)
        got = decoder.decode_eager(windows, 36)
    assert float((got - want).abs().max()) < 1e-4


# Its set-up (`decoder_on`, `fused_and_layers`, `window_batch`, `_vocode`) is what the CPU
# tests here run on the CPU.
@pytest.mark.gpu
def test_cuda_decodes_on_the_fused_kernels_within_tolerance():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    got, want = fused_and_layers("cuda", "bfloat16")
    assert relative_rms(got, want) < 2**-6
    got, want = fused_and_layers("cuda", "float32")
    print(f"fused vs layers, float32 pass: rms {relative_rms(got, want):.1e}")
    assert relative_rms(got, want) < 1e-4
    decoder = decoder_on("cuda", "bfloat16")
    assert decoder.fused_dit is not None
    windows = window_batch(decoder, 3, 60)
    with torch.inference_mode():
        fused = decoder.decode_eager(windows, 60)
        decoder.fused_dit = None
        layered = decoder.decode_eager(windows, 60)
    print(f"fused vs layers, bf16 window: rms {relative_rms(fused, layered):.1e}")
    assert relative_rms(fused, layered) < BF16_RMS_TOLERANCE
    # BigVGAN's one-kernel activations against its modules on the GPU (float32; the
    # kernels sum taps in their own order, through about a hundred convolutions).
    mel = torch.randn(2, decoder.mel_dim, 48, device="cuda")
    with torch.inference_mode():
        one_kernel = decoder._vocode(mel)
        decoder.fused_activations = False
        modules = decoder._vocode(mel)
    print(f"one-kernel activations vs modules: rms {relative_rms(one_kernel, modules):.1e}")
    assert relative_rms(one_kernel, modules) < 1e-3


def test_bigvgan_with_one_kernel_activations_runs_transformers_ops():
    """`_vocode`'s CUDA path (each activation through `anti_alias_snake`, here its torch
    reference, and the AMP blocks written out around it) against the path that runs
    transformers' modules: the same ops, so the same bits."""
    decoder = decoder_on("cpu", "float32")
    mel = torch.randn(2, decoder.mel_dim, 30, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        want = decoder._vocode(mel)
        decoder.fused_activations = True
        got = decoder._vocode(mel)
    assert torch.equal(got, want)
    assert float(want.abs().max()) > 0
