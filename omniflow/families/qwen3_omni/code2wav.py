"""Qwen3-Omni's code2wav as a decoder of the vocoder backend (`omniflow.backends.vocoders`):
16 codebooks per 12.5 Hz frame, summed embeddings, a sliding-window causal transformer, then
a causal ConvNet upsampling x1920 to 24 kHz (`Qwen3OmniMoeCode2Wav`, transformers' modules).

How far it looks is walked from its modules (`code2wav_field`), as for the codecs:

- back: every transformer layer attends `sliding_window` frames (itself and the 71 before
  it, in the published config), and stacked layers add up (8 x 71 = 568 frames), then the
  convolutions' left context, a few frames more (578 in all). `chunked_decode`, which
  `generate` uses, gives each 300-code chunk 25 frames of left context only: past 300 codes
  it is not the whole decode (nor, below, continuous).
- ahead: its "causal" transposed convolutions trim `kernel - stride` samples off both ends,
  so each upsampling block's output reads one input position ahead: one frame of lookahead
  in all. The same trim leaves a decode of n frames `tail` samples short of n x 1920 (555
  in the published config): the last frame's end is never computed, whatever follows.

Carried state. It decodes statefully (`omniflow.backends.carried_state`): each stream's
convolution tails and each attention layer's keys and values of the last 71 frames live in
its slot, allocated when the stage loads, so a window decodes only its new frames (no left
context: the family's `code2wav` part `carries_state`) and a stream's audio is its
whole-utterance decode, up to float rounding, in windows of any size, one frame included.
`carried_forward` walks transformers' own modules (their weights; each SnakeBeta one
kernel on CUDA, `omniflow.kernels.snake_beta`) with that state. The left
trims make the streamed ConvNet run late: a window's samples end `tail` samples short of
its last frame (`Carried.delay`; a new stream's positions before its start are zeroed, as
the whole decode pads). So a window returns the audio of the frames one before its new ones
(`lag`, its lookahead), completed with the samples the previous window computed past its
last whole frame (carried too); a stream's last window runs one frame past its end, and the
samples that no decode computes there are zeros: the stage's audio is the whole decode and
then `tail` zeros, as `generate`'s plus the rest of its last frame.

Static windows: a step's inputs are the padded codes and each row's slot, position and
length, so it is captured as a CUDA graph per (batch bucket, window length) on CUDA (the
stage's decode "graphs"; "static" runs the same buffers eagerly on the CPU), as
Qwen3-TTS's code2wav: `carried_state.StatefulDecoder`. Precision "auto" on CUDA is
bfloat16, the checkpoint's dtype; the slots follow the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet,
    Qwen3OmniMoeCausalTransConvNet,
    Qwen3OmniMoeCode2Wav,
    Qwen3OmniMoeCode2WavDecoderBlock,
    Qwen3OmniMoeCode2WavDecoderResidualUnit,
    Qwen3OmniMoeConvNeXtBlock,
    Qwen3OmniMoeSnakeBeta,
    apply_rotary_pos_emb,
)

from omniflow.backends import receptive_field
from omniflow.backends.carried_state import Carried, StatefulDecoder, sliding_window
from omniflow.backends.receptive_field import Field
from omniflow.backends.vocoders import VocoderError, checked_samples_per_frame, field_reach
from omniflow.dtypes import cast_model
from omniflow.hf_logging import quiet
from omniflow.kernels.snake_beta import snake_beta

COMPONENT = "code2wav"
# "float32": transformers' own arithmetic on a float32 copy; "bfloat16": the checkpoint's
# dtype, in which `generate` runs it (what "auto" means on CUDA).
PRECISIONS = ("float32", "bfloat16")


def load(root: str, component: str | None, device: str) -> Code2Wav:
    """The code2wav of the Qwen3-Omni checkpoint at `root`."""
    if component != COMPONENT:
        raise VocoderError(
            f"Qwen3-Omni's vocoder is its '{COMPONENT}', not '{component}'; "
            f'use component="{COMPONENT}" (the thinker and talker run on ar stages)'
        )
    from transformers import Qwen3OmniMoeConfig

    with quiet():
        config = Qwen3OmniMoeConfig.from_pretrained(root).code2wav_config
        # The checkpoint holds the whole model; code2wav's weights sit under `code2wav.`.
        model = Qwen3OmniMoeCode2Wav.from_pretrained(
            root, config=config, key_mapping={r"^code2wav\.": ""}, dtype=torch.float32
        )
    return Code2Wav(model, device)


# --- the receptive field, walked in forward order --------------------------------------------


def code2wav_field(model: Qwen3OmniMoeCode2Wav) -> tuple[Field, int]:
    """Frame 0's field in the waveform of `model`, and `tail`: the samples a decode of n
    frames lacks at its end, short of n x samples per frame (the transposed convolutions'
    right trims, through the layers after them). The code embedding's mean and the final
    clamp are per frame and per sample."""
    return convnet_field(model, transformer_field(model, Field(0, 0)))


def transformer_field(model: Qwen3OmniMoeCode2Wav, field: Field) -> Field:
    """Through the pre-transformer's sliding-window causal attention layers."""
    for layer in model.pre_transformer.layers:
        field = receptive_field.causal_attention(field, layer.self_attn.sliding_window)
    return field


def convnet_field(model: Qwen3OmniMoeCode2Wav, field: Field) -> tuple[Field, int]:
    """Through the ConvNet after the transformer (the upsampling ConvNeXt stages, then the
    decoder blocks); with `tail` as for `code2wav_field`."""
    tail = 0
    for upsample, convnext in model.upsample:
        field, tail = _transposed(field, tail, upsample)
        field = _convnext(field, convnext)
    for block in model.decoder:
        if isinstance(block, Qwen3OmniMoeCausalConvNet):
            field = _causal(field, block)
        elif isinstance(block, Qwen3OmniMoeCode2WavDecoderBlock):
            for layer in block.block:
                if isinstance(layer, Qwen3OmniMoeCausalTransConvNet):
                    field, tail = _transposed(field, tail, layer)
                elif isinstance(layer, Qwen3OmniMoeCode2WavDecoderResidualUnit):
                    branch = _causal(_causal(field, layer.conv1), layer.conv2)
                    field = receptive_field.union(field, branch)
                elif not isinstance(layer, Qwen3OmniMoeSnakeBeta):
                    raise VocoderError(f"no receptive field for {type(layer).__name__}")
        elif not isinstance(block, Qwen3OmniMoeSnakeBeta):
            raise VocoderError(f"no receptive field for {type(block).__name__}")
    return field, tail


def _causal(field: Field, layer: Qwen3OmniMoeCausalConvNet) -> Field:
    """All of the padding on the left; a stride other than 1 would pad the right too."""
    conv = layer.conv
    if conv.stride[0] != 1:
        raise VocoderError("a strided causal convolution in code2wav: no receptive field for it")
    return receptive_field.conv(field, conv.kernel_size[0], 1, layer.padding, conv.dilation[0])


def _transposed(
    field: Field, tail: int, layer: Qwen3OmniMoeCausalTransConvNet
) -> tuple[Field, int]:
    """A transposed convolution trimmed by `left_pad` and `right_pad` samples: n inputs give
    n x stride + (kernel - stride) - left - right outputs."""
    conv = layer.conv
    kernel, stride = conv.kernel_size[0], conv.stride[0]
    field = receptive_field.shift(receptive_field.conv_transpose1d(field, conv), -layer.left_pad)
    return field, tail * stride - (kernel - stride) + layer.left_pad + layer.right_pad


def _convnext(field: Field, block: Qwen3OmniMoeConvNeXtBlock) -> Field:
    """Its residual: the causal depthwise convolution, then per-position layers."""
    return receptive_field.union(field, _causal(field, block.dwconv))


# --- the decoder -------------------------------------------------------------------------


class Code2Wav(StatefulDecoder):
    """Qwen3-Omni code2wav, streamed with its carried state (see the module docstring):
    `carried_forward` walks transformers' own modules, their weights, with each stream's
    convolution tails and attention keys and values carried in its slot."""

    precisions = PRECISIONS

    def __init__(self, model: Qwen3OmniMoeCode2Wav, device: str):
        config = model.config
        self.model = model.to(device).eval()
        self.device = device
        if any(kind != "sliding_attention" for kind in config.layer_types):
            raise VocoderError(f"code2wav with {config.layer_types} layers: not one it streams")
        field, self.tail = code2wav_field(self.model)
        self.per_frame = field.per_frame

        def decode(frames: int) -> torch.Tensor:
            codes = torch.zeros(1, config.num_quantizers, frames, dtype=torch.int64, device=device)
            return F.pad(self.model(codes), (0, self.tail))

        with torch.inference_mode():
            samples = checked_samples_per_frame(field, decode)
        reach = field_reach(field)
        # Frames a window's audio lags its new frames by: those the `tail` samples span.
        self.lag = -(-self.tail // self.per_frame)
        if self.lag != reach.lookahead:
            raise VocoderError(
                f"code2wav's last {self.tail} samples span {self.lag} frames, but it looks "
                f"{reach.lookahead} ahead"
            )
        super().__init__(
            samples_per_frame=samples,
            num_codebooks=config.num_quantizers,
            codebook_size=config.codebook_size,
            reach=reach,
            lookahead=self.lag,
        )

    def set_precision(self, precision: str) -> None:
        super().set_precision(precision)
        cast_model(self.model, torch.bfloat16 if precision == "bfloat16" else torch.float32)
        if self.states is not None:  # the slots hold the model's dtype
            self.init_states(self.states.slots)

    def carried_forward(self, codes: torch.Tensor, carried: Carried) -> torch.Tensor:
        """`Qwen3OmniMoeCode2Wav.forward` over each row's new frames, then aligned: the audio
        of the frames `lag` before them, which ends `tail` samples into the row's last frame
        (the samples after it zeros)."""
        if codes.shape[1] != self.num_codebooks:
            raise VocoderError(
                f"code2wav decodes frames of {self.num_codebooks} codebooks, not {codes.shape[1]}"
            )
        model, frames = self.model, codes.shape[-1]
        hidden = model.code_embedding(codes + model.code_offset).mean(1)
        wav = _streamed_transformer(model.pre_transformer, hidden, carried).permute(0, 2, 1)
        for transposed, convnext in model.upsample:
            wav = carried.transposed_conv(transposed.conv, wav, transposed.left_pad)
            wav = _streamed_convnext(convnext, wav, carried)
        for block in model.decoder:
            if isinstance(block, Qwen3OmniMoeCode2WavDecoderBlock):
                for layer in block.block:
                    wav = _streamed(layer, wav, carried)
            else:
                wav = _streamed(block, wav, carried)
        if carried.delay != self.tail:
            raise VocoderError(f"code2wav streamed {carried.delay} samples late, not {self.tail}")
        # Before it, the last frames' samples the previous window computed (the `lag` frames
        # end `tail` samples short): `lag` frames of audio back, whole frames again.
        pending = self.lag * self.per_frame - self.tail
        wav = carried.extend(wav.clamp(min=-1, max=1), pending)[..., : frames * self.per_frame]
        sample = torch.arange(wav.shape[-1], device=wav.device)
        computed = sample[None] < carried.lengths[:, None] * self.per_frame + pending
        return torch.where(
            computed[:, None], wav, torch.zeros((), dtype=wav.dtype, device=wav.device)
        )


def _streamed_transformer(pre, hidden: torch.Tensor, carried: Carried) -> torch.Tensor:
    """`Qwen3OmniMoeCode2WavTransformerModel.forward` over the new frames, each attention
    layer's keys and values of the `sliding_window - 1` frames before them carried."""
    b, t, _ = hidden.shape
    window = pre.layers[0].self_attn.sliding_window
    positions, mask, past = sliding_window(carried, t, window, hidden.device)
    cos, sin = pre.rotary_emb(hidden, positions)
    for layer in pre.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        shape = (b, t, -1, attn.head_dim)
        q = attn.q_norm(attn.q_proj(x).view(shape)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(x).view(shape)).transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = carried.extend(k, past, dim=2), carried.extend(v, past, dim=2)
        if attn.num_key_value_groups > 1:
            k = k.repeat_interleave(attn.num_key_value_groups, dim=1)
            v = v.repeat_interleave(attn.num_key_value_groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling)
        out = attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        hidden = hidden + layer.self_attn_layer_scale(out)
        mlp = layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = hidden + layer.mlp_layer_scale(mlp)
    return pre.norm(hidden)


def _streamed_convnext(
    block: Qwen3OmniMoeConvNeXtBlock, x: torch.Tensor, carried: Carried
) -> torch.Tensor:
    h = carried.causal_conv(block.dwconv.conv, x, block.dwconv.padding).permute(0, 2, 1)
    h = block.gamma * block.pwconv2(block.act(block.pwconv1(block.norm(h))))
    return x + h.permute(0, 2, 1)


def _streamed(layer, x: torch.Tensor, carried: Carried) -> torch.Tensor:
    """One of the ConvNet's layers after the upsampling stages, streamed."""
    if isinstance(layer, Qwen3OmniMoeCausalConvNet):
        return carried.causal_conv(layer.conv, x, layer.padding)
    if isinstance(layer, Qwen3OmniMoeCausalTransConvNet):
        return carried.transposed_conv(layer.conv, x, layer.left_pad)
    if isinstance(layer, Qwen3OmniMoeCode2WavDecoderResidualUnit):
        h = _streamed(layer.conv1, _snake(layer.act1, x), carried)
        return x + _streamed(layer.conv2, _snake(layer.act2, h), carried)
    if isinstance(layer, Qwen3OmniMoeSnakeBeta):
        return _snake(layer, x)
    raise VocoderError(f"no streamed form of {type(layer).__name__}")


def _snake(layer: Qwen3OmniMoeSnakeBeta, x: torch.Tensor) -> torch.Tensor:
    """The module's activation, one kernel on CUDA (`omniflow.kernels.snake_beta`: its
    reference is the module's forward)."""
    return snake_beta(x, layer.alpha, layer.beta)
