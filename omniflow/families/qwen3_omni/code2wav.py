"""Qwen3-Omni's code2wav as a decoder of the vocoder backend (`omniflow.backends.vocoders`):
16 codebooks per 12.5 Hz frame, summed embeddings, a sliding-window causal transformer, then
a causal ConvNet upsampling x1920 to 24 kHz (`Qwen3OmniMoeCode2Wav`, transformers' modules).

How far it looks is walked from its modules (`code2wav_field`), as for the codecs:

- back: every transformer layer attends `sliding_window` frames (itself and the 71 before
  it, in the published config), and stacked layers add up (8 x 71 = 568 frames), then the
  convolutions' left context, a few frames more. A stream whose left context covers that
  decodes exactly its whole-utterance decode. `chunked_decode`, which `generate` uses, gives
  each 300-code chunk 25 frames of left context only: past 300 codes it is not that decode
  (nor, below, continuous).
- ahead: its "causal" transposed convolutions trim `kernel - stride` samples off both ends,
  so each upsampling block's output reads one input position ahead: one frame of lookahead
  in all. The same trim leaves a decode of n frames `tail` samples short of n x 1920 (555
  in the published config): the last frame's end is never computed, whatever follows. A
  window here emits only frames whose lookahead arrived, so a stream's audio equals the
  whole decode, and its last frame ends in `tail` zeros where the whole decode ends early.
  (`chunked_decode` drops those samples at the end of every chunk.)

The ConvNet's own reach is a few frames (`convnet_field`): a window runs the transformer
over its whole context and the ConvNet only over what its kept frames need.

Padding: the convolutions pad with zeros on the left as the utterance's start does, but a
padded frame's codes still embed to something, so windows are padded only where the
vocoder backend's reach rule allows (right after the lookahead, or left before the context).
"""

from __future__ import annotations

import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet,
    Qwen3OmniMoeCausalTransConvNet,
    Qwen3OmniMoeCode2Wav,
    Qwen3OmniMoeCode2WavDecoderBlock,
    Qwen3OmniMoeCode2WavDecoderResidualUnit,
    Qwen3OmniMoeConvNeXtBlock,
    Qwen3OmniMoeSnakeBeta,
)

from omniflow.backends import receptive_field
from omniflow.backends.receptive_field import Field
from omniflow.backends.vocoders import (
    Decoder,
    VocoderError,
    Window,
    checked_samples_per_frame,
    field_reach,
    padded,
)
from omniflow.hf_logging import quiet

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
    return Code2Wav(root, device)


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


class Code2Wav(Decoder):
    """Qwen3-Omni code2wav: a local decoder (no grid), frames of `num_quantizers` codes.

    A window runs the transformer over all its frames (its left context is the
    transformer's long reach), and the ConvNet only from `convnet_context` frames before
    the first frame it keeps: the ConvNet's own reach, far shorter, where nearly all of the
    decode's work is. Every kept sample is what the whole forward gives."""

    precisions = PRECISIONS

    def __init__(self, root: str, device: str):
        from transformers import Qwen3OmniMoeConfig

        with quiet():
            config = Qwen3OmniMoeConfig.from_pretrained(root).code2wav_config
            # The checkpoint holds the whole model; code2wav's weights sit under `code2wav.`.
            model = Qwen3OmniMoeCode2Wav.from_pretrained(
                root, config=config, key_mapping={r"^code2wav\.": ""}, dtype=torch.float32
            )
        self.model = model.to(device).eval()
        self.device = device
        self.codebooks = config.num_quantizers
        field, self.tail = code2wav_field(self.model)
        self.per_frame = field.per_frame
        self.convnet_context = int(receptive_field.context(convnet_field(model, Field(0, 0))[0]))

        def decode(frames: int) -> torch.Tensor:
            codes = torch.zeros(1, self.codebooks, frames, dtype=torch.int64, device=device)
            return self._run(codes, 0)

        with torch.inference_mode():
            samples = checked_samples_per_frame(field, decode)
        reach = field_reach(field)
        super().__init__(
            samples_per_frame=samples,
            num_codebooks=self.codebooks,
            codebook_size=config.codebook_size,
            reach=reach,
            lookahead=int(reach.lookahead),
        )

    def set_precision(self, precision: str) -> None:
        super().set_precision(precision)
        self.model.to(torch.bfloat16 if precision == "bfloat16" else torch.float32)

    def _run(self, codes: torch.Tensor, keep: int) -> torch.Tensor:
        """codes `[B, Q, T]` -> audio `[B, T * samples per frame]` from frame `keep` on (zeros
        before it): `Qwen3OmniMoeCode2Wav.forward` in two halves, the ConvNet started at
        `keep - convnet_context`; then `tail` zeros where the waveform ends short."""
        if codes.shape[1] != self.codebooks:
            raise VocoderError(
                f"code2wav decodes frames of {self.codebooks} codebooks, not {codes.shape[1]}"
            )
        model, frames = self.model, codes.shape[-1]
        hidden = model.code_embedding(codes + model.code_offset).mean(1)
        hidden = model.pre_transformer(inputs_embeds=hidden).last_hidden_state
        start = max(0, keep - self.convnet_context)
        wav = hidden[:, start:].permute(0, 2, 1)
        for blocks in model.upsample:
            for block in blocks:
                wav = block(wav)
        for block in model.decoder:
            wav = block(wav)
        wav = wav.clamp(min=-1, max=1)[:, 0]
        if wav.shape[-1] != (frames - start) * self.per_frame - self.tail:
            raise VocoderError(
                f"{frames - start} frames decode to {wav.shape[-1]} samples, not the "
                f"{(frames - start) * self.per_frame - self.tail} that code2wav's layers make"
            )
        return torch.nn.functional.pad(wav, (start * self.per_frame, self.tail))

    def decode(self, windows: list[Window], frames: int) -> torch.Tensor:
        codes = padded(windows, frames, Window.codes, self.device).transpose(1, 2)
        keep = min(w.offset + w.keep_start - w.start for w in windows)
        return self._run(codes, keep)
