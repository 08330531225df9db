"""Vocoder stages: codec frames in, waveform out, decoded while the frames stream in.

`Vocoder` is the ("vocoder", "transformers") backend. It picks a `Decoder` by the
component's architecture -- Qwen2.5-Omni's token2wav (`Token2Wav`: a flow-matching DiT from
codes to mel, BigVGAN from mel to waveform) or an audio codec that transformers ships
(`CodecDecoder`: DAC, Mimi, EnCodec) -- and streams every one of them the same way.

Streaming. Each step decodes *windows*: the frames it may now emit (the kept frames), up
to `context` frames before them (the edge's left context) and `lookahead` frames after
them, and emits only the kept frames' audio, one row of `samples_per_frame` samples per
frame. A frame is kept once its lookahead has arrived; at end of stream all the rest is.
How far a decoder looks follows from its architecture: when it loads, its real modules are
walked in forward order (kernel sizes, strides, paddings and dilations of its convolutions,
its anti-aliasing filters' lengths, attention windows) through the interval arithmetic of
receptive_field.py, in exact integers. Measuring it instead (change a frame, see which
samples change) would depend on the machine: at a field's edges the influence is small
enough that float rounding decides whether it shows. One decode at load checks that the
samples per frame are those the walk found. A codec's default lookahead is its reach:
causal codecs (Mimi, EnCodec) need none, DAC's symmetric convolutions as many frames ahead
as behind (9 on tiny:tts). A decoder that looks no farther than the context and lookahead
streams exactly its whole-utterance decode, up to rounding; EnCodec's LSTM remembers every
frame, so its stream only approximates it.

Token2wav's DiT is not local: each of its passes attends one 24-mel-frame block (12 codes)
back and one ahead, and a sample takes 36 passes (10 RK4 steps), so influence keeps
spreading. It is decoded in windows on a fixed grid of one-block units — one unit, then two,
then four at a time (`WINDOW_BLOCKS` in the model catalog, which the compiler sizes the
edge's chunks by) — each starting on a block boundary, so its waveform does not depend on
how the codes happened to be chunked: the reference interpreter and every runtime mode
agree, whatever the timing. Two blocks of context and of lookahead bring the stream within
about 1e-4 of the whole-utterance decode; one block of lookahead (Qwen's own streaming
setting) within about 1e-2 (tests/backends/test_vocoders.py measures both). Its initial
noise is drawn per arriving frame from a generator seeded with the request's `seed`: the
numbers one `torch.randn` over the whole utterance draws after `torch.manual_seed(seed)`, so
every window slices the same fixed noise.

Batching. A step decodes every ready window of every request in one forward, padded to
the longest. Padding never reaches kept samples: a window is padded on the right only if
its kept frames end at least the decoder's lookahead reach before its end, else on the
left only if they start at least its context reach after its start, and never if it is
shorter than the decoder's `min_frames`; a window that allows none of these (a whole short
utterance) goes in a forward of windows of its own length. Token2wav's DiT masks padding
out of attention exactly; the rule covers its BigVGAN, which reaches 18 mel frames (9 codes)
each way on tiny:qwen2.5-omni.
"""

from __future__ import annotations

import dataclasses
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable

import torch
from torch import nn
from transformers import AutoModel, Qwen2_5OmniConfig
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
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniAMPBlock,
    Qwen2_5OmniAntiAliasedActivation1d,
    Qwen2_5OmniToken2WavBigVGANModel,
    Qwen2_5OmniToken2WavModel,
)
from transformers.utils import cached_file

from omniflow.backends import receptive_field
from omniflow.backends.receptive_field import Field
from omniflow.errors import OmniflowError
from omniflow.models.catalog import CODEC_TYPES, WINDOW_BLOCKS, block_grid
from omniflow.models.resolve import model_path
from omniflow.models.tiny_recipes import quiet
from omniflow.runtime.stage import Backend, Call, StageSpec

# Qwen2_5OmniForConditionalGeneration.generate's default speaker.
DEFAULT_SPEAKER = "Chelsie"


class VocoderError(OmniflowError):
    """A vocoder stage cannot load its model, or cannot decode one request's codes."""


@dataclasses.dataclass(frozen=True)
class Reach:
    """How far a decoder looks, from its architecture (`field_reach`).

    `context` and `lookahead`: frames of input before and after an output frame that its
    samples depend on (math.inf: unbounded). `min_frames`: the shortest input that decodes as
    the beginning of any longer one; shorter inputs differ (EnCodec's reflect padding, given
    no more samples than it reflects, pads them with zeros first), so they are never padded.
    """

    context: float
    lookahead: float
    min_frames: float = 1


def field_reach(field: Field) -> Reach:
    """The reach of a decoder whose waveform input frame 0 influences within `field`."""
    return Reach(receptive_field.context(field), receptive_field.lookahead(field), field.min_frames)


def checked_samples_per_frame(field: Field, decode: Callable[[int], torch.Tensor]) -> int:
    """`field.per_frame`, once `decode(frames)` (the waveform of that many frames) agrees: the
    architecture walked is the one that runs."""
    frames = field.min_frames
    samples = decode(frames).numel()
    if samples != frames * field.per_frame:
        raise VocoderError(
            f"{frames} frames decode to {samples} samples, not the {field.per_frame} per frame "
            "that the decoder's layers make"
        )
    return field.per_frame


# --- receptive fields of the decoders' modules, walked in their forward order ----------------


def bigvgan_field(model: Qwen2_5OmniToken2WavBigVGANModel) -> Field:
    """Mel frame 0's field in the waveform of Qwen2.5-Omni's BigVGAN (its mel preprocessing and
    the final clamp are elementwise)."""
    field = receptive_field.conv1d(Field(0, 0), model.conv_pre)
    blocks = model.num_residual_blocks
    for index, (upsample,) in enumerate(model.ups):
        field = receptive_field.conv_transpose1d(field, upsample)
        parallel = model.resblocks[index * blocks : (index + 1) * blocks]  # averaged
        field = receptive_field.union(*(_amp_block_field(field, block) for block in parallel))
    field = _anti_aliased_field(field, model.activation_post)
    return receptive_field.conv1d(field, model.conv_post)


def _amp_block_field(field: Field, block: Qwen2_5OmniAMPBlock) -> Field:
    acts1, acts2 = block.activations[::2], block.activations[1::2]
    for conv1, conv2, act1, act2 in zip(block.convs1, block.convs2, acts1, acts2, strict=True):
        branch = receptive_field.conv1d(_anti_aliased_field(field, act1), conv1)
        branch = receptive_field.conv1d(_anti_aliased_field(branch, act2), conv2)
        field = receptive_field.union(field, branch)
    return field


def _anti_aliased_field(field: Field, activation: Qwen2_5OmniAntiAliasedActivation1d) -> Field:
    """Upsampling filter, elementwise SnakeBeta, downsampling filter; their replicate padding
    and trimming only move positions."""
    up, down = activation.upsample, activation.downsample
    field = receptive_field.shift(field, up.pad)
    field = receptive_field.conv_transpose(field, up.filter.shape[-1], up.stride)
    field = receptive_field.shift(field, -up.pad_left)
    return receptive_field.conv(field, down.filter.shape[-1], down.stride, down.pad_left)


def codec_field(model) -> Field:
    """Frame 0's field in the waveform of a DAC, Mimi or EnCodec model's decoder. Frames enter
    them through codebook lookups and 1x1 projections, which act frame by frame."""
    if model.config.model_type == "dac":
        return _dac_field(model.decoder)
    if model.config.model_type == "mimi":
        return _mimi_field(model.decoder)
    return _seanet_field(Field(0, 0), model.decoder.layers)


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


# --- per-request streams and their windows ----------------------------------------------------


@dataclasses.dataclass
class _Stream:
    """One request's frames: those from `base` on that a future window may still need."""

    state: dict
    lookahead: int
    codes: torch.Tensor
    side: torch.Tensor | None = None  # per-frame decoder inputs beside the codes (noise)
    base: int = 0
    emitted: int = 0

    @property
    def arrived(self) -> int:
        return self.base + len(self.codes)

    def forget_before(self, frame: int) -> None:
        drop = max(0, frame - self.base)
        self.codes = self.codes[drop:]
        if self.side is not None:
            self.side = self.side[drop:]
        self.base += drop


@dataclasses.dataclass(eq=False)
class Window:
    """Frames `start:end` of a stream decoded together to emit `keep_start:keep_end`;
    `offset` is where `start` sits in the padded batch."""

    stream: _Stream
    start: int
    end: int
    keep_start: int
    keep_end: int
    offset: int = 0

    @property
    def frames(self) -> int:
        return self.end - self.start

    def codes(self) -> torch.Tensor:
        return self.stream.codes[self.start - self.stream.base : self.end - self.stream.base]

    def side(self) -> torch.Tensor:
        return self.stream.side[self.start - self.stream.base : self.end - self.stream.base]


def padded(windows: list[Window], frames: int, part: Callable[[Window], torch.Tensor], device):
    """`[B, frames, ...]`: each window's `part` at its offset, zeros around it."""
    first = part(windows[0])
    out = torch.zeros((len(windows), frames, *first.shape[1:]), dtype=first.dtype, device=device)
    for row, window in enumerate(windows):
        out[row, window.offset : window.offset + window.frames] = part(window)
    return out


# --- decoders ----------------------------------------------------------------------------


class Decoder(ABC):
    """One architecture's decode: a padded batch of code windows -> their waveforms.

    `reach` is that of the part of the decoder that padding is not masked out of;
    `lookahead` the frames of lookahead it needs by default. `unit` None means frames decode
    exactly given the reach, so each request's ready frames merge into one window per step;
    otherwise windows follow a fixed grid of `unit` frames, which window starts and the
    context keep to.
    """

    def __init__(
        self,
        samples_per_frame: int,
        num_codebooks: int,
        codebook_size: int,
        reach: Reach,
        lookahead: int,
        unit: int | None = None,
    ):
        self.samples_per_frame = samples_per_frame
        self.num_codebooks = num_codebooks
        self.codebook_size = codebook_size
        self.reach = reach
        self.lookahead = lookahead
        self.unit = unit

    def open(self, call: Call) -> dict:
        """Per-request decoder state from the request's parameters."""
        return {}

    def side(self, state: dict, frames: int) -> torch.Tensor | None:
        """Per-frame inputs beside the codes for `frames` new frames, drawn in frame order."""
        return None

    def group(self, state: dict) -> Hashable:
        """Requests whose windows may share a forward have equal groups."""
        return None

    @abstractmethod
    def decode(self, windows: list[Window], frames: int) -> torch.Tensor:
        """`[len(windows), frames * samples_per_frame]` float32 audio of the padded batch."""


class CodecDecoder(Decoder):
    """The decoder of a transformers audio codec (DAC, Mimi, EnCodec) from its codes."""

    def __init__(self, model, device: str):
        self.model = model.to(device).eval()
        self.device = device
        config = model.config
        self.kind = config.model_type
        if self.kind == "encodec":
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
            num_codebooks = model.quantizer.get_num_quantizers_for_bandwidth(bandwidth)
        else:
            num_codebooks = config.n_codebooks if self.kind == "dac" else config.num_quantizers
        field = codec_field(model)

        def decode(frames: int) -> torch.Tensor:
            return self._run(
                torch.zeros(1, num_codebooks, frames, dtype=torch.int64, device=device)
            )

        with torch.inference_mode():
            per_frame = checked_samples_per_frame(field, decode)
        reach = field_reach(field)
        super().__init__(per_frame, num_codebooks, config.codebook_size, reach, reach.lookahead)

    def _run(self, codes: torch.Tensor) -> torch.Tensor:
        """codes `[B, Q, T]` -> audio `[B, T * samples_per_frame]`."""
        if self.kind == "dac":
            audio = self.model.decode(audio_codes=codes).audio_values
        elif self.kind == "mimi":
            audio = self.model.decode(codes).audio_values
        else:
            audio = self.model.decode(codes[None], [None]).audio_values
        return audio.reshape(len(codes), -1)

    def decode(self, windows: list[Window], frames: int) -> torch.Tensor:
        return self._run(padded(windows, frames, Window.codes, self.device).transpose(1, 2))


class Token2Wav(Decoder):
    """Qwen2.5-Omni token2wav: a flow-matching DiT samples mel (`repeats` frames per code)
    with classifier-free guidance, BigVGAN turns mel into waveform.

    It runs the model's own modules; the sampling loop is written out here (transformers'
    `sample` draws its noise from the global RNG and cannot batch requests): per-request
    noise and speakers, padded rows masked out of attention, speaker encodings computed once
    per speaker instead of once per DiT pass. Request parameters: `speaker` (default
    Chelsie), `seed` (0), `steps` (10 ODE steps), `guidance` (0.5).
    """

    def __init__(self, root: str, device: str):
        with quiet():
            config = Qwen2_5OmniConfig.from_pretrained(root).token2wav_config
            # The checkpoint holds the whole omni model; its token2wav weights sit under
            # `token2wav.`. transformers runs token2wav in float32 whatever the checkpoint's dtype.
            model = Qwen2_5OmniToken2WavModel.from_pretrained(
                root, config=config, key_mapping={r"^token2wav\.": ""}, dtype=torch.float32
            )
        self.model = model.to(device).eval()
        self.device = device
        self.dit = model.code2wav_dit_model
        self.bigvgan = model.code2wav_bigvgan_model
        dit_config = config.dit_config
        self.repeats, self.mel_dim = dit_config.repeats, dit_config.mel_dim
        self.block_size = dit_config.block_size
        speakers = torch.load(cached_file(root, "spk_dict.pt"), weights_only=True)
        with torch.inference_mode():
            self.speakers = {name: self._speaker(value) for name, value in speakers.items()}
        field = bigvgan_field(self.bigvgan)

        def decode(frames: int) -> torch.Tensor:
            return self.bigvgan(torch.zeros(1, self.mel_dim, frames, device=device))

        with torch.inference_mode():
            mel_samples = checked_samples_per_frame(field, decode)
        mel_reach = dataclasses.astuple(field_reach(field))
        unit, lookahead = block_grid({"dit_config": dit_config.to_dict()})
        super().__init__(
            samples_per_frame=mel_samples * self.repeats,
            num_codebooks=1,
            # DiTCodecEmbedding holds num_embeds + 1 rows.
            codebook_size=dit_config.num_embeds + 1,
            reach=Reach(*(_codes(mel, self.repeats) for mel in mel_reach)),
            lookahead=lookahead,
            unit=unit,
        )

    def _speaker(self, entry: dict) -> dict:
        """What one speaker conditions every DiT pass with, with and without guidance."""
        encoder = self.dit.input_embed.spk_encoder
        ref_mel = entry["ref_mel"].float().to(self.device)
        return {
            "cond": entry["cond"].float().reshape(-1).to(self.device),
            "ref": encoder(ref_mel)[0],
            "ref_dropped": encoder(torch.zeros_like(ref_mel))[0],
        }

    def open(self, call: Call) -> dict:
        params = call.params
        name = params.get("speaker") or (
            DEFAULT_SPEAKER if DEFAULT_SPEAKER in self.speakers else next(iter(self.speakers))
        )
        if name not in self.speakers:
            raise VocoderError(f"unknown speaker '{name}'; known: {', '.join(self.speakers)}")
        steps = 10 if params.get("steps") is None else params["steps"]
        if not isinstance(steps, int) or steps < 2:
            raise VocoderError(f"steps must be an integer of at least 2, not {steps!r}")
        guidance = params.get("guidance")
        seed = params.get("seed")
        return {
            "speaker": self.speakers[name],
            "steps": steps,
            "guidance": 0.5 if guidance is None else float(guidance),
            "noise": torch.Generator().manual_seed(0 if seed is None else int(seed)),
        }

    def side(self, state: dict, frames: int) -> torch.Tensor:
        # Frame by frame, so the numbers do not depend on how the frames were chunked.
        draws = [
            torch.randn(self.repeats, self.mel_dim, generator=state["noise"]) for _ in range(frames)
        ]
        return torch.stack(draws)

    def group(self, state: dict) -> Hashable:
        return state["steps"]

    def decode(self, windows: list[Window], frames: int) -> torch.Tensor:
        device, rows = self.device, len(windows)
        codes = padded(windows, frames, lambda w: w.codes()[:, 0], device)
        noise = padded(windows, frames, Window.side, device).reshape(rows, -1, self.mel_dim)
        length = noise.shape[1]
        # Mel positions relative to each window's start; padding gets a block of its own far
        # from every real one, so look-back/ahead attention never reaches it.
        offsets = torch.tensor([w.offset * self.repeats for w in windows], device=device)
        lengths = torch.tensor([w.frames * self.repeats for w in windows], device=device)
        position = torch.arange(length, device=device)[None] - offsets[:, None]
        real = (position >= 0) & (position < lengths[:, None])
        block = torch.where(real, position.div(self.block_size, rounding_mode="floor"), 1 << 30)
        block = torch.cat([block, block])
        block_diff = (block[:, None, :] - block[:, :, None])[:, None]
        block_diff = block_diff.expand(-1, self.dit.num_attention_heads, -1, -1)
        speakers = [w.stream.state["speaker"] for w in windows]
        conditioning = torch.stack(
            [s["ref"] for s in speakers] + [s["ref_dropped"] for s in speakers]
        )[:, None].expand(-1, length, -1)
        cond = torch.stack([s["cond"] for s in speakers])[:, None].expand(-1, length, -1)
        cond = torch.cat([cond, torch.zeros_like(cond)])
        embed = self.dit.text_embed
        code_embed = torch.cat([embed(codes), embed(codes, drop_code=True)])
        guidance = torch.tensor([w.stream.state["guidance"] for w in windows], device=device)
        guidance = guidance[:, None, None]
        positions = torch.cat([position, position])
        # The same for every pass: it depends on the positions and the hidden dtype only.
        rotary = self.dit.rotary_embed(code_embed, positions)

        def velocity(time: torch.Tensor, mel: torch.Tensor) -> torch.Tensor:
            """The guided DiT prediction (Qwen2_5OmniToken2WavDiTModel.forward, batched)."""
            time_embedding = self.dit.time_embed(time.repeat(2 * rows))
            hidden = torch.cat([mel, mel])
            hidden = self.dit.input_embed.proj(
                torch.cat((hidden, conditioning, code_embed, cond), dim=-1)
            )
            for layer in self.dit.transformer_blocks:
                hidden = layer(
                    hidden, time_embedding, position_embeddings=rotary, block_diff=block_diff
                )
            hidden = self.dit.norm_out(hidden, time_embedding)
            guided, dropped = self.dit.proj_out(hidden).chunk(2)
            return guided + (guided - dropped) * guidance

        steps = windows[0].stream.state["steps"]
        # Qwen2_5OmniToken2WavDiTModel.sample's time points, sway coefficient -1.
        time = torch.linspace(0, 1, steps, device=device, dtype=noise.dtype)
        time = time - (torch.cos(torch.pi / 2 * time) - 1 + time)
        mel = runge_kutta4(velocity, noise, time)
        return self.bigvgan(mel.permute(0, 2, 1)).reshape(rows, -1)


def _window_units(start: int) -> int:
    """The units of the window that starts at unit `start` on the grid WINDOW_BLOCKS lays."""
    boundary = 0
    for units in WINDOW_BLOCKS[:-1]:
        if start < boundary + units:
            return units
        boundary += units
    return WINDOW_BLOCKS[-1]


def runge_kutta4(velocity: Callable, value: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
    """The value at `time[-1]`: transformers' `RungeKutta4ODESolver.integrate(time)[-1]`,
    operation for operation, without its per-step comparisons of device tensors on the host,
    which wait for the GPU each step and keep it from running ahead of the host."""
    third = 1 / 3
    for start, end in zip(time[:-1], time[1:], strict=True):
        step = end - start
        k1 = velocity(start, value)
        k2 = velocity(start + step * third, value + step * k1 * third)
        k3 = velocity(start + step * (2 / 3), value + step * (k2 - k1 * third))
        k4 = velocity(end, value + step * (k1 - k2 + k3))
        value = value + (k1 + 3 * (k2 + k3) + k4) * step / 8
    return value


def _codes(mel_frames: float, repeats: int) -> float:
    """Mel frames as the codes that cover them."""
    return mel_frames if mel_frames == math.inf else math.ceil(mel_frames / repeats)


def _read_json(root: str, name: str, subfolder: str = "") -> dict | None:
    path = cached_file(
        root,
        name,
        subfolder=subfolder,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
    )
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_decoder(model: str, component: str | None, device: str) -> Decoder:
    """The decoder of `model`'s `component`, chosen by the component's architecture."""
    root = model_path(model)
    index = _read_json(root, "model_index.json")
    if index is not None and isinstance(index.get(component), list):
        part = _read_json(root, "config.json", component) or {}
        if part.get("model_type") in CODEC_TYPES:
            with quiet():
                return CodecDecoder(AutoModel.from_pretrained(root, subfolder=component), device)
        raise VocoderError(
            f"{model} [{component}] is a {part.get('model_type', 'model without a config')}, "
            f"not a codec omniflow can decode ({', '.join(CODEC_TYPES)})"
        )
    config = _read_json(root, "config.json") or {}
    kind = config.get("model_type")
    if kind == "qwen2_5_omni" and component == "token2wav":
        return Token2Wav(root, device)
    if kind in CODEC_TYPES and component in (None, kind):
        with quiet():
            return CodecDecoder(AutoModel.from_pretrained(root), device)
    raise VocoderError(
        f"no vocoder for {model} [{component}] ({kind or 'no config.json'}); supported: "
        f"Qwen2.5-Omni token2wav and the {', '.join(CODEC_TYPES)} codecs"
    )


# --- the backend --------------------------------------------------------------------------


class Vocoder(Backend):
    """Streams codec frames to audio; see the module docstring for windows and batching.

    Request parameters: `lookahead` (frames; default: what the decoder needs to match its
    whole-utterance decode), besides the decoder's own (token2wav: `speaker`, `seed`,
    `steps`, `guidance`).
    """

    def __init__(self, spec: StageSpec, device: str):
        super().__init__(spec, device)
        ports = [port for port, kind in spec.inputs.items() if kind == "codes"]
        if len(ports) != 1 or "audio" not in spec.outputs:
            raise VocoderError(
                f"stage '{spec.plan.name}': a vocoder takes one codes input and has an audio output"
            )
        if not spec.plan.model:
            raise VocoderError(f"stage '{spec.plan.name}': a vocoder needs a model")
        self.port = ports[0]
        self.decoder = load_decoder(spec.plan.model, spec.plan.component, device)
        planned = tuple(spec.outputs["audio"].shape)
        if planned != (self.decoder.samples_per_frame,):
            raise VocoderError(
                f"stage '{spec.plan.name}': the plan sizes audio rows as {planned}, but "
                f"{spec.plan.model} [{spec.plan.component}] makes "
                f"{self.decoder.samples_per_frame} samples per frame"
            )
        align = self.decoder.unit or 1
        context = spec.contexts.get(self.port, 0)
        self.context = context - context % align

    def ready(self, call: Call) -> bool:
        stream = call.inputs[self.port]
        return stream.available() or stream.ended

    def step(self, calls: list[Call]) -> None:
        live: list[tuple[Call, list[Window]]] = []
        for call in calls:
            try:
                stream = self._receive(call)
            except VocoderError as err:
                call.fail(err)
                continue
            live.append((call, self._windows(stream, call.inputs[self.port].ended)))
        audio = self._decode([w for _, windows in live for w in windows])
        for call, windows in live:
            stream = call.state["stream"]
            if windows:
                call.emit("audio", torch.cat([audio[w] for w in windows]))
                stream.emitted = windows[-1].keep_end
                stream.forget_before(stream.emitted - self.context)
            if call.inputs[self.port].ended and stream.emitted == stream.arrived:
                call.finish()

    def drop(self, call: Call) -> None:
        call.state.pop("stream", None)

    def _receive(self, call: Call) -> _Stream:
        """Open the request's stream on its first step, and append what arrived."""
        decoder = self.decoder
        stream = call.state.get("stream")
        if stream is None:
            lookahead = call.params.get("lookahead")
            lookahead = decoder.lookahead if lookahead is None else lookahead
            if not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 0:
                raise VocoderError(f"lookahead must be a whole number of frames, not {lookahead!r}")
            stream = _Stream(
                decoder.open(call),
                lookahead,
                torch.zeros(0, 0, dtype=torch.int64, device=self.device),
            )
            call.state["stream"] = stream
        chunk = call.inputs[self.port].take()
        if chunk is None or not len(chunk):
            return stream
        if chunk.dim() != 2 or not 1 <= chunk.shape[1] <= decoder.num_codebooks:
            raise VocoderError(
                f"codes must be [frames, codebooks] with 1 to {decoder.num_codebooks} "
                f"codebooks, not {list(chunk.shape)}"
            )
        if chunk.is_floating_point() or chunk.is_complex():
            raise VocoderError(f"codes must be integers, not {chunk.dtype}")
        if len(stream.codes) and chunk.shape[1] != stream.codes.shape[1]:
            raise VocoderError("the number of codebooks changed within a request")
        low, high = int(chunk.min()), int(chunk.max())
        if low < 0 or high >= decoder.codebook_size:
            raise VocoderError(
                f"code {low if low < 0 else high} is outside the codebook (0..{decoder.codebook_size - 1}); "
                "a codec LM's token ids need its codec offset subtracted"
            )
        codes = chunk.to(device=self.device, dtype=torch.int64)
        # cat copies: the chunk may be a view into a channel slot released after the step.
        stream.codes = torch.cat([stream.codes.reshape(-1, codes.shape[1]), codes])
        side = decoder.side(stream.state, len(codes))
        if side is not None:
            side = side.to(self.device)
            stream.side = side if stream.side is None else torch.cat([stream.side, side])
        return stream

    def _windows(self, stream: _Stream, ended: bool) -> list[Window]:
        arrived, done, unit = stream.arrived, stream.emitted, self.decoder.unit
        ready = arrived if ended else arrived - stream.lookahead
        if unit is None:
            spans = [(done, ready)] if ready > done else []
        else:
            spans = []
            while done < arrived:
                end = done + unit * _window_units(done // unit)
                if end > ready and not ended:
                    break
                spans.append((done, min(end, arrived)))
                done = end
        return [
            Window(stream, max(0, k0 - self.context), min(arrived, k1 + stream.lookahead), k0, k1)
            for k0, k1 in spans
        ]

    def _decode(self, windows: list[Window]) -> dict[Window, torch.Tensor]:
        """Each window's kept audio, `[kept frames, samples_per_frame]`."""
        decoder, per_frame = self.decoder, self.decoder.samples_per_frame
        groups: dict[Hashable, list[Window]] = {}
        for window in windows:
            groups.setdefault(decoder.group(window.stream.state), []).append(window)
        out = {}
        with torch.inference_mode():
            for group in groups.values():
                for frames, batch in self._forwards(group):
                    audio = decoder.decode(batch, frames).float().cpu()
                    for row, w in zip(audio, batch, strict=True):
                        first = (w.offset + w.keep_start - w.start) * per_frame
                        kept = row[first : first + (w.keep_end - w.keep_start) * per_frame]
                        out[w] = kept.reshape(-1, per_frame).contiguous()
        return out

    def _forwards(self, windows: list[Window]) -> list[tuple[int, list[Window]]]:
        """Split windows into forwards, (frames, windows at their offsets): one padded to the
        longest window, and for the windows that padding would reach, more of their own."""
        reach, forwards = self.decoder.reach, []
        while windows:
            frames = max(w.frames for w in windows)
            batch, rest = [], []
            for w in windows:
                pad = frames - w.frames
                long_enough = w.frames >= reach.min_frames
                if pad == 0 or long_enough and w.end - w.keep_end >= reach.lookahead:
                    w.offset = 0  # padded on the right, if at all
                elif long_enough and w.keep_start - w.start >= reach.context:
                    w.offset = pad
                else:
                    rest.append(w)
                    continue
                batch.append(w)
            forwards.append((frames, batch))
            windows = rest
        return forwards
