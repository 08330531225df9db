"""The audio codecs transformers ships, as vocoder decoders: `CodecDecoder` and one subclass
per codec (DAC, Mimi, EnCodec), loaded by the checkpoint's `model_type` (`load`).

How far a decoder looks follows from its architecture: its real modules are walked in
forward order (kernel sizes, strides, paddings and dilations of its convolutions, attention
windows) through the interval arithmetic of `omniflow.backends.receptive_field`, in exact
integers. Causal codecs (Mimi, EnCodec) need no lookahead, DAC's symmetric convolutions as
many frames ahead as behind (9 on tiny:tts). A decoder that looks no farther than the
context and lookahead streams exactly its whole-utterance decode, up to rounding;
EnCodec's LSTM remembers every frame, so its stream only approximates it.
"""

from __future__ import annotations

import math
from abc import abstractmethod

import torch
from torch import nn
from transformers import AutoModel
from transformers.models.dac.modeling_dac import DacDecoder
from transformers.models.encodec.modeling_encodec import (
    EncodecConv1d,
    EncodecConvTranspose1d,
    EncodecLSTM,
    EncodecResnetBlock,
)
from transformers.models.mimi.modeling_mimi import (
    MimiConv1d,
    MimiConvTranspose1d,
    MimiDecoderModel,
    MimiResnetBlock,
)

from omniflow.backends import receptive_field
from omniflow.backends.checkpoint_files import INDEX, part_architecture, parts, read_json
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


def load(root: str, component: str | None, device: str) -> CodecDecoder:
    """The codec at `root` (or its part `component`), by the `model_type` it declares."""
    kind = part_architecture(root, component)
    codecs = {"dac": DacCodec, "mimi": MimiCodec, "encodec": EncodecCodec}
    if kind not in codecs:
        raise VocoderError(
            f"{root} [{component}] is a {kind or 'model without a config'}, not a codec "
            f"omniflow can decode ({', '.join(codecs)})"
        )
    return codecs[kind](root, component, device)


class CodecDecoder(Decoder):
    """The decoder of a transformers audio codec, from its codes; a subclass per codec says
    how many codebooks it reads, how far its decoder looks and how it is called.

    Registered by the codec's `model_type`; loads the codec at `root`, or its part
    `component` where the checkpoint's index names it (tiny:tts's code2wav)."""

    def __init__(self, root: str, component: str | None, device: str):
        index = read_json(root, INDEX)
        subfolder = component if index is not None and component in parts(index) else ""
        with quiet():
            self.model = AutoModel.from_pretrained(root, subfolder=subfolder).to(device).eval()
        self.device = device
        num_codebooks = self._num_codebooks()
        field = self.field()

        def decode(frames: int) -> torch.Tensor:
            return self._run(
                torch.zeros(1, num_codebooks, frames, dtype=torch.int64, device=device)
            )

        with torch.inference_mode():
            per_frame = checked_samples_per_frame(field, decode)
        reach = field_reach(field)
        codebook_size = self.model.config.codebook_size
        super().__init__(per_frame, num_codebooks, codebook_size, reach, reach.lookahead)

    @abstractmethod
    def _num_codebooks(self) -> int:
        """Codebooks per frame the decoder reads."""

    @abstractmethod
    def field(self) -> Field:
        """Frame 0's field in the waveform. Frames enter a codec's decoder through codebook
        lookups and 1x1 projections, which act frame by frame."""

    @abstractmethod
    def _waveform(self, codes: torch.Tensor) -> torch.Tensor:
        """The codec's own decode of codes `[B, Q, T]`."""

    def _run(self, codes: torch.Tensor) -> torch.Tensor:
        """codes `[B, Q, T]` -> audio `[B, T * samples_per_frame]`."""
        return self._waveform(codes).reshape(len(codes), -1)

    def decode(self, windows: list[Window], frames: int) -> torch.Tensor:
        return self._run(padded(windows, frames, Window.codes, self.device).transpose(1, 2))


class DacCodec(CodecDecoder):
    """DAC (tiny:tts's code2wav): symmetric convolutions, looking as far ahead as back."""

    def _num_codebooks(self) -> int:
        return self.model.config.n_codebooks

    def field(self) -> Field:
        return _dac_field(self.model.decoder)

    def _waveform(self, codes: torch.Tensor) -> torch.Tensor:
        return self.model.decode(audio_codes=codes).audio_values


class MimiCodec(CodecDecoder):
    """Mimi: a sliding-window causal transformer, then causal SEANet convolutions."""

    def _num_codebooks(self) -> int:
        return self.model.config.num_quantizers

    def field(self) -> Field:
        return _mimi_field(self.model.decoder)

    def _waveform(self, codes: torch.Tensor) -> torch.Tensor:
        return self.model.decode(codes).audio_values


class EncodecCodec(CodecDecoder):
    """EnCodec, mono and decoded in one chunk: SEANet convolutions and an LSTM that
    remembers every frame."""

    def _num_codebooks(self) -> int:
        config = self.model.config
        # (time_group_norm normalizes over the whole utterance: no finite reach.)
        if (
            config.chunk_length is not None
            or config.audio_channels != 1
            or config.norm_type != "weight_norm"
        ):
            raise VocoderError(
                "only mono, weight-normed EnCodec models that decode in one chunk (24 kHz) "
                "are supported"
            )
        bandwidth = max(config.target_bandwidths)
        return self.model.quantizer.get_num_quantizers_for_bandwidth(bandwidth)

    def field(self) -> Field:
        return _seanet_field(Field(0, 0), self.model.decoder.layers)

    def _waveform(self, codes: torch.Tensor) -> torch.Tensor:
        return self.model.decode(codes[None], [None]).audio_values


# --- receptive fields of the codecs' decoders, walked in their forward order -----------------


def _dac_field(decoder: DacDecoder) -> Field:
    field = receptive_field.conv1d(Field(0, 0), decoder.conv1)
    for block in decoder.block:  # Snake and tanh are elementwise
        field = receptive_field.conv_transpose1d(field, block.conv_t1)
        for unit in (block.res_unit1, block.res_unit2, block.res_unit3):
            branch = receptive_field.conv1d(receptive_field.conv1d(field, unit.conv1), unit.conv2)
            field = receptive_field.union(field, branch)
    return receptive_field.conv1d(field, decoder.conv2)


def _mimi_field(decoder: MimiDecoderModel) -> Field:
    field = Field(0, 0)
    if decoder.upsample is not None:
        field = _seanet_conv_transpose_field(field, decoder.upsample)
    for layer in decoder.decoder_transformer.layers:
        field = receptive_field.causal_attention(field, layer.self_attn.sliding_window)
    return _seanet_field(field, decoder.decoder_seanet.layers)


def _seanet_field(field: Field, layers) -> Field:
    """Through SEANet layers (Mimi's and EnCodec's decoders and their residual blocks)."""
    for layer in layers:
        if isinstance(layer, (MimiConv1d, EncodecConv1d)):
            field = _seanet_conv_field(field, layer)
        elif isinstance(layer, (MimiConvTranspose1d, EncodecConvTranspose1d)):
            field = _seanet_conv_transpose_field(field, layer)
        elif isinstance(layer, (MimiResnetBlock, EncodecResnetBlock)):
            shortcut = _seanet_field(field, [layer.shortcut])
            field = receptive_field.union(shortcut, _seanet_field(field, layer.block))
        elif isinstance(layer, EncodecLSTM):
            field = receptive_field.recurrent(field)
        elif not isinstance(layer, (nn.ELU, nn.Identity)):
            raise VocoderError(f"no receptive field for the decoder layer {type(layer).__name__}")
    return field


def _seanet_conv_field(field: Field, layer: MimiConv1d | EncodecConv1d) -> Field:
    conv = layer.conv
    kernel, stride, dilation = conv.kernel_size[0], conv.stride[0], conv.dilation[0]
    # Padded as the forward pads: all on the left if causal, else evenly, the odd one left.
    total = (kernel - 1) * dilation + 1 - stride
    left = total if layer.causal else total - total // 2
    if layer.pad_mode == "reflect":
        # `_pad1d` zero-pads inputs no longer than the padding before reflecting them (plus up
        # to stride - 1 positions on the right, which `pad_for_conv1d` adds).
        field = receptive_field.needs_more_than(field, max(left, total - left + stride - 1))
    return receptive_field.conv(field, kernel, stride, left, dilation)


def _seanet_conv_transpose_field(
    field: Field, layer: MimiConvTranspose1d | EncodecConvTranspose1d
) -> Field:
    conv = layer.conv
    total = conv.kernel_size[0] - conv.stride[0]
    # The forward trims this much on the right (all of it if causal), the rest on the left.
    right = math.ceil(total * layer.trim_right_ratio) if layer.causal else total // 2
    field = receptive_field.conv_transpose1d(field, conv)
    return receptive_field.shift(field, right - total)
