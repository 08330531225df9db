"""Qwen2.5-Omni's token2wav as a decoder of the vocoder backend (`omniflow.backends.vocoders`):
a flow-matching DiT from codes to mel, then BigVGAN from mel to waveform.

Token2wav's DiT is not local: each of its passes attends one 24-mel-frame block (12 codes)
back and one ahead, and a sample takes 36 passes (10 RK4 steps), so influence keeps
spreading. It is decoded in windows on a fixed grid of one-block units — one unit, then
two, four, then sixteen at a time (`WINDOW_BLOCKS` in the model catalog, which the compiler
sizes the edge's chunks by) — each starting on a block boundary, so its waveform does not
depend on how the codes happened to be chunked: the reference interpreter and every runtime mode
agree, whatever the timing. Two blocks of context and of lookahead bring the stream within
about 1e-4 of the whole-utterance decode; one block of lookahead (Qwen's own streaming
setting) within about 1e-2 (tests/backends/test_vocoders.py measures both). Its initial
noise is drawn per arriving frame from a generator seeded with the request's `seed`: the
numbers one `torch.randn` over the whole utterance draws after `torch.manual_seed(seed)`, so
every window slices the same fixed noise.

The DiT masks padding out of attention exactly; the vocoder backend's padding rule covers
the BigVGAN, which reaches 18 mel frames (9 codes) each way on tiny:qwen2.5-omni.

On CUDA (the stage's `precision` and `decode`, docs/backends.md) the DiT runs in bf16, its
blocks on fused kernels (`omniflow.families.qwen2_5_omni.token2wav_dit`), and a window's whole
decode replays from CUDA graphs captured at load per (window length, batch bucket) over
static buffers (`prepare`): the solve's begin, one RK4 step (4 DiT passes) replayed for each
of its 9 steps, then BigVGAN; a window of another shape, or another step count, decodes
eagerly. A graph's capture costs the host time of the work it captures (a whole solve's
36 passes took ~0.5 s of Python a window at real size), so a step captured once keeps the
stage's load short. The solve (`_solve`) is device work only for that reason: the window
layout arrives as tensors, the codec embedding repeats by expanding and BigVGAN's clamp
level is made once, where transformers' modules would read sizes back from or copy scalars
to the GPU. BigVGAN's 109 anti-aliased SnakeBeta activations run as one kernel each
(`omniflow.kernels.anti_alias_snake`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Hashable

import numpy as np
import torch
from transformers import Qwen2_5OmniConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniAMPBlock,
    Qwen2_5OmniAntiAliasedActivation1d,
    Qwen2_5OmniToken2WavBigVGANModel,
    Qwen2_5OmniToken2WavModel,
)
from transformers.utils import cached_file

from omniflow.backends import receptive_field
from omniflow.backends.cuda_graphs import Graphs
from omniflow.backends.receptive_field import Field
from omniflow.backends.static_decode import batch_buckets
from omniflow.backends.vocoders import (
    Decoder,
    Reach,
    VocoderError,
    Window,
    checked_samples_per_frame,
    field_reach,
    padded,
)
from omniflow.dtypes import cast_model
from omniflow.families.qwen2_5_omni import token2wav_block_grid
from omniflow.families.qwen2_5_omni.token2wav_dit import FusedDiT
from omniflow.hf_logging import quiet
from omniflow.kernels import ada_norm
from omniflow.kernels.anti_alias_snake import anti_alias_snake
from omniflow.runtime.readback import upload
from omniflow.runtime.stage import Call

COMPONENT = "token2wav"
# Qwen2_5OmniForConditionalGeneration.generate's default speaker.
DEFAULT_SPEAKER = "Chelsie"
# ODE steps of a request that names none (transformers' default); static windows are made
# for it.
DEFAULT_STEPS = 10
# "float32": transformers' own; "tf32": float32 weights, matmuls on TF32 tensor cores (CUDA);
# "bfloat16": the DiT's weights and activations in bf16, the ODE's state in float32.
PRECISIONS = ("float32", "tf32", "bfloat16")
# The largest batch of windows captured; a larger forward replays in parts of this many.
GRAPH_BATCH = 8
# The most codes a captured batch holds (a longer window has fewer buckets): each window's
# graphs cost load time (their captures run 4 DiT passes and BigVGAN of Python; one eager
# run per length precedes them), and from 8 windows of 96 codes a DiT pass's matrices (3072
# rows) keep the tensor cores busy, so a graph buys nothing over eager (H200, fused DiT: 10
# windows of 240 codes take 0.49 s replayed, 0.47 s eager; one takes 72 ms replayed, 0.46 s
# eager).
GRAPH_CODES = 8 * 96


def load(root: str, component: str | None, device: str) -> Token2Wav:
    """The token2wav of the Qwen2.5-Omni checkpoint at `root`."""
    if component != COMPONENT:
        raise VocoderError(
            f"Qwen2.5-Omni's vocoder is its '{COMPONENT}', not '{component}'; "
            f'use component="{COMPONENT}" (the thinker and talker run on ar stages)'
        )
    return Token2Wav(root, device)


# --- BigVGAN's receptive field, walked in its forward order ----------------------------------


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


# --- the decoder -------------------------------------------------------------------------


class Token2Wav(Decoder):
    """Qwen2.5-Omni token2wav: a flow-matching DiT samples mel (`repeats` frames per code)
    with classifier-free guidance, BigVGAN turns mel into waveform.

    It runs the model's own modules; the sampling loop is written out here (transformers'
    `sample` draws its noise from the global RNG and cannot batch requests): per-request
    noise and speakers, padded rows masked out of attention, speaker encodings computed once
    per speaker instead of once per DiT pass. Request parameters: `speaker` (default
    Chelsie), `seed` (0), `steps` (10 ODE steps), `guidance` (0.5).
    """

    precisions = PRECISIONS
    static_windows = True

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
        unit, lookahead = token2wav_block_grid({"dit_config": dit_config.to_dict()})
        # BigVGAN's clamp level (its amplitude_to_db makes it per call, from the host).
        self.min_level = torch.exp(
            torch.tensor(-115 / 20.0 * np.log(10), device=device, dtype=torch.float32)
        )
        self.precision, self.dtype = "float32", torch.float32
        self.fused_dit = self._fuse()
        self.default_modulations: torch.Tensor | None = None  # `_modulations`, at `prepare`
        # On CUDA each of BigVGAN's anti-aliased activations is one kernel; elsewhere
        # transformers' modules run, so CPU results stay theirs bit for bit.
        self.fused_activations = device.startswith("cuda")
        self.graphs: Graphs | None = None
        self.batch_buckets: list[int] = []
        self.window_lengths: list[int] = []
        self.eager_windows = 0  # windows decoded eagerly, for want of a static window
        super().__init__(
            samples_per_frame=mel_samples * self.repeats,
            num_codebooks=1,
            # DiTCodecEmbedding holds num_embeds + 1 rows.
            codebook_size=dit_config.num_embeds + 1,
            reach=Reach(*(_codes(mel, self.repeats) for mel in mel_reach)),
            lookahead=lookahead,
            unit=unit,
        )

    def set_precision(self, precision: str) -> None:
        """Run the DiT in `precision` (one of PRECISIONS; float32 until set), before any
        static windows are made. The speaker encodings stay those float32 made."""
        super().set_precision(precision)
        if self.graphs is not None:
            raise VocoderError("set the precision before the static windows are made")
        if self.precision != "float32":
            raise VocoderError(f"token2wav's precision is already {self.precision}")
        self.precision = precision
        if precision == "bfloat16":
            self.dtype = torch.bfloat16
            cast_model(self.dit, self.dtype)
            # `.to()` gave every weight a tensor of its own: stack them again.
            self.fused_dit = self._fuse()

    def _fuse(self) -> FusedDiT | None:
        """The DiT's blocks on fused kernels where they compile (CUDA with Triton); elsewhere
        transformers' modules run them."""
        fusable = self.device.startswith("cuda") and ada_norm.triton is not None
        return FusedDiT(self.dit) if fusable else None

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
        steps = DEFAULT_STEPS if params.get("steps") is None else params["steps"]
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

    # --- the window decode ----------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, windows: list[Window], frames: int) -> torch.Tensor:
        largest = self.static_batch(frames) or len(windows)
        if len(windows) > largest:  # in forwards of the largest static batch
            parts = [windows[i : i + largest] for i in range(0, len(windows), largest)]
            return torch.cat([self.decode(part, frames) for part in parts])
        steps = windows[0].stream.state["steps"]
        key = (frames, self.batch_bucket(len(windows)), steps)
        if self.graphs is None or (*key, "begin") not in self.graphs:
            self.eager_windows += len(windows)
            return self.decode_eager(windows, frames)
        self.graphs.run((*key, "begin"), self._inputs(windows, frames))
        for _ in range(steps - 1):
            self.graphs.run((*key, "step"), {})
        audio = self.graphs.run((*key, "end"), {})
        # A copy: the buffer belongs to the graphs, and the next window overwrites it.
        return audio[: len(windows)].clone()

    def static_batch(self, frames: int) -> int | None:
        """The most windows of `frames` codes a forward decodes at once: the largest batch of
        static windows that long (of another length, the largest bucket, whose forwards run
        eagerly; None without static windows). A batch is captured up to GRAPH_CODES codes
        (`_static`), so a forward of more windows of a long length runs in parts that were:
        eagerly, 5 windows of 240 codes would hold the executor's loop for ~0.4 s of
        launches (at c=32, omni chat's code2wav steps of 3 and 4 windows held it 265-315 ms:
        docs/benchmarks-log.md)."""
        if frames not in self.window_lengths:
            return self.batch_buckets[-1] if self.batch_buckets else None
        return max(b for b in self.batch_buckets if _static(b, frames))

    @torch.inference_mode()
    def decode_eager(self, windows: list[Window], frames: int) -> torch.Tensor:
        """`decode` without static windows, at the batch's own shape: what a forward of a
        shape without a static window runs, and what a graph's replay is checked against."""
        steps = windows[0].stream.state["steps"]
        return self._solve(steps=steps, **self._inputs(windows, frames))

    def _inputs(self, windows: list[Window], frames: int) -> dict[str, torch.Tensor]:
        """The padded batch as the tensors `_solve` reads (built on the host side of a window
        decode; a graph's replay reads copies of them)."""
        device, rows = self.device, len(windows)
        speakers = [w.stream.state["speaker"] for w in windows]
        return {
            "codes": padded(windows, frames, lambda w: w.codes()[:, 0], device),
            "noise": padded(windows, frames, Window.side, device).reshape(rows, -1, self.mel_dim),
            # Where each window starts in the padded batch, and how long it is, in mel frames
            # (these and the guidance sent without waiting for the stage's queued work).
            "offsets": upload([w.offset * self.repeats for w in windows], device),
            "lengths": upload([w.frames * self.repeats for w in windows], device),
            "ref": torch.stack([s["ref"] for s in speakers]),
            "ref_dropped": torch.stack([s["ref_dropped"] for s in speakers]),
            "cond": torch.stack([s["cond"] for s in speakers]),
            "guidance": upload([w.stream.state["guidance"] for w in windows], device),
        }

    def _solve(self, codes, noise, offsets, lengths, ref, ref_dropped, cond, guidance, steps):
        """Audio `[B, samples]` of a padded batch: the DiT's ODE solve, then BigVGAN. Device
        work only, at shapes fixed by the inputs' (what a static window's graphs capture, a
        phase each: `_begin`, `_step` replayed steps - 1 times, `_end`): no host syncs."""
        solve = self._begin(codes, noise, offsets, lengths, ref, ref_dropped, cond, guidance, steps)
        for _ in range(steps - 1):
            self._step(solve)
        return self._end(solve)

    def _begin(self, codes, noise, offsets, lengths, ref, ref_dropped, cond, guidance, steps):
        """A solve's state: what every DiT pass of it reads (the window layout as the DiT's
        attention takes it, its rotary, the conditioning, the code embeddings, the
        guidance), the time points, the index of the step to run next and the ODE's value
        (the noise, float32)."""
        device, dtype = self.device, self.dtype
        length = noise.shape[1]
        # Mel positions relative to each window's start; padding gets a block of its own far
        # from every real one, so look-back/ahead attention never reaches it.
        position = torch.arange(length, device=device)[None] - offsets[:, None]
        real = (position >= 0) & (position < lengths[:, None])
        block = torch.where(real, position.div(self.block_size, rounding_mode="floor"), 1 << 30)
        block = torch.cat([block, block])
        if self.fused_dit:
            attention = block.to(torch.int32)  # each position's block: the fused blocks' layout
        else:  # transformers' layers take block distances
            attention = (block[:, None, :] - block[:, :, None])[:, None]
        cond = cond.to(dtype)[:, None]
        code_embed = torch.cat([self._code_embed(codes, False), self._code_embed(codes, True)])
        # The same for every pass: it depends on the positions and the hidden dtype only.
        cos, sin = self.dit.rotary_embed(code_embed, torch.cat([position, position]))
        time = self._time_points(steps)
        solve = {"modulation": self._modulations(steps, time)} if self.fused_dit else {}
        return solve | {
            "value": noise.clone(),
            "time": time,
            "at": torch.zeros(1, dtype=torch.int64, device=device),
            "attention": attention,
            "cos": cos,
            "sin": sin,
            "conditioning": torch.cat([ref, ref_dropped]).to(dtype)[:, None],
            "cond": torch.cat([cond, torch.zeros_like(cond)]),
            "code_embed": code_embed,
            "guidance": guidance[:, None, None],
        }

    def _time_points(self, steps: int) -> torch.Tensor:
        """Qwen2_5OmniToken2WavDiTModel.sample's time points, sway coefficient -1
        (float32)."""
        time = torch.linspace(0, 1, steps, device=self.device)
        return time - (torch.cos(torch.pi / 2 * time) - 1 + time)

    def _modulations(self, steps: int, time: torch.Tensor) -> torch.Tensor:
        """The fused blocks' modulation for every pass of a solve of `steps` steps at `time`'s
        points, row 4 x step + stage (`_step`): the default step count's table, made before
        any static window (every window's graphs read it), else one a solve."""
        if steps == DEFAULT_STEPS and self.default_modulations is not None:
            return self.default_modulations
        return self._modulations_at(time)

    def _modulations_at(self, time: torch.Tensor) -> torch.Tensor:
        passes = torch.stack(_rk4_points(time[:-1], time[1:]), dim=1).flatten()
        return self.fused_dit.modulations(self._time_embedding(passes))

    def _step(self, solve: dict) -> None:
        """One RK4 step of `solve` from its time point `at` to the next, in place (the
        value, then `at`): transformers' `RungeKutta4ODESolver.integrate`'s step, operation
        for operation, without its comparisons of device tensors on the host, which wait for
        the GPU each step and keep it from running ahead of the host."""
        at, time, value = solve["at"], solve["time"], solve["value"]
        start, end = time.index_select(0, at), time.index_select(0, at + 1)
        step, third = end - start, 1 / 3
        points = _rk4_points(start, end)
        with self._matmul_precision():
            k1 = self._velocity(solve, points, 0, value)
            k2 = self._velocity(solve, points, 1, value + step * k1 * third)
            k3 = self._velocity(solve, points, 2, value + step * (k2 - k1 * third))
            k4 = self._velocity(solve, points, 3, value + step * (k1 - k2 + k3))
        value.copy_(value + (k1 + 3 * (k2 + k3) + k4) * step / 8)
        at.add_(1)

    def _time_embedding(self, time: torch.Tensor) -> torch.Tensor:
        """DiTTimestepEmbedding of `time` `[n]`: `[n, D]` in the DiT's dtype, its sinusoid in
        float32 (at bf16, 1000 t's phase would be off by whole radians)."""
        timing = self.dit.time_embed
        embedding = timing.time_embed(time).to(self.dtype)
        for layer in timing.time_mlp:
            embedding = layer(embedding)
        return embedding

    def _velocity(self, solve: dict, points: tuple, stage: int, mel: torch.Tensor) -> torch.Tensor:
        """The guided DiT prediction at the step's RK4 point `stage` of `points`
        (`_rk4_points`; Qwen2_5OmniToken2WavDiTModel.forward, batched), in the DiT's dtype;
        the ODE's state and the guidance stay float32. The fused blocks take the pass's row
        of the solve's modulations; transformers' layers a time embedding per row."""
        fused, dtype = self.fused_dit, self.dtype
        rows, length = mel.shape[:2]
        if fused:
            row = solve["at"] * len(points) + stage
            timing = solve["modulation"].index_select(0, row)
        else:
            timing = self._time_embedding(points[stage].repeat(2 * rows))
        hidden = torch.cat([mel, mel]).to(dtype)
        conditioning = solve["conditioning"].expand(-1, length, -1)
        cond = solve["cond"].expand(-1, length, -1)
        hidden = self.dit.input_embed.proj(
            torch.cat((hidden, conditioning, solve["code_embed"], cond), dim=-1)
        )
        rotary = solve["cos"], solve["sin"]
        if fused:
            hidden = fused(hidden, timing, rotary, solve["attention"])
        else:
            block_diff = solve["attention"].expand(-1, self.dit.num_attention_heads, -1, -1)
            for layer in self.dit.transformer_blocks:
                hidden = layer(hidden, timing, position_embeddings=rotary, block_diff=block_diff)
            hidden = self.dit.norm_out(hidden, timing)
        guided, dropped = self.dit.proj_out(hidden).float().chunk(2)
        return guided + (guided - dropped) * solve["guidance"]

    def _end(self, solve: dict) -> torch.Tensor:
        """The solved mel through BigVGAN: audio `[B, samples]`."""
        return self._vocode(solve["value"].permute(0, 2, 1))

    def _code_embed(self, codes: torch.Tensor, drop: bool) -> torch.Tensor:
        """DiTCodecEmbedding's forward, its repeat as an expand: `repeat_interleave` may read
        its output size back from the GPU, which a graph cannot."""
        embed = self.dit.text_embed.codec_embed(torch.zeros_like(codes) if drop else codes)
        rows, frames, width = embed.shape
        return embed[:, :, None].expand(-1, -1, self.repeats, -1).reshape(rows, -1, width)

    def _vocode(self, mel: torch.Tensor) -> torch.Tensor:
        """BigVGAN's forward on mel `[B, mel_dim, T]` -> `[B, samples]`, op for op, with its
        clamp level made once at load rather than per call (a host-to-device copy) and
        without its final copy to the CPU."""
        g = self.bigvgan
        fused = self.fused_activations
        decibels = 20 * torch.log10(torch.clamp(torch.exp(mel), min=self.min_level)) - 20
        hidden = g.conv_pre(g.normalize_spectrogram(decibels, 1, -115))
        blocks = g.num_residual_blocks
        for index in range(g.num_upsample_layers):
            hidden = g.ups[index][0](hidden)
            parallel = g.resblocks[index * blocks : (index + 1) * blocks]
            if fused:
                hidden = sum(self._fused_amp_block(block, hidden) for block in parallel) / blocks
            else:
                hidden = sum(block(hidden) for block in parallel) / blocks
        if fused:
            hidden = self._fused_activation(g.activation_post, hidden)
        else:
            hidden = g.activation_post(hidden)
        waveform = g.conv_post(hidden)
        return torch.clamp(waveform, min=-1.0, max=1.0)[:, 0]

    @staticmethod
    def _fused_activation(
        activation: Qwen2_5OmniAntiAliasedActivation1d, hidden: torch.Tensor
    ) -> torch.Tensor:
        """The activation's forward as one kernel (`omniflow.kernels.anti_alias_snake`)."""
        up, down, snake = activation.upsample, activation.downsample, activation.act
        return anti_alias_snake(
            hidden, snake.alpha, snake.beta, up.filter, down.filter, up.ratio, down.stride
        )

    @classmethod
    def _fused_amp_block(cls, block: Qwen2_5OmniAMPBlock, hidden: torch.Tensor) -> torch.Tensor:
        """Qwen2_5OmniAMPBlock.forward, its activations each one kernel."""
        acts1, acts2 = block.activations[::2], block.activations[1::2]
        for conv1, conv2, act1, act2 in zip(block.convs1, block.convs2, acts1, acts2, strict=True):
            branch = conv2(cls._fused_activation(act2, conv1(cls._fused_activation(act1, hidden))))
            hidden = hidden + branch
        return hidden

    @contextlib.contextmanager
    def _matmul_precision(self):
        """float32 matmuls on TF32 tensor cores for the "tf32" precision (captured that way
        too), restored after: the setting is process-wide."""
        if self.precision != "tf32":
            yield
            return
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(before)

    # --- static windows -------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, lengths: list[int], max_batch: int, capture: bool) -> None:
        """Static buffers for windows of each of `lengths` codes at each batch bucket up to
        `max_batch` (at most GRAPH_BATCH), for the default step count, captured as CUDA
        graphs when `capture` (else solved eagerly on the buffers), for batches of up to
        GRAPH_CODES codes (one window always). A window's solve is three graphs over one
        static state: its begin (the state from the inputs), one RK4 step (replayed for every
        step: its capture runs 4 of the solve's 36 DiT passes of Python, not all of them) and
        its end (BigVGAN). Captured largest first, in one pool; each length's phases run
        eagerly once, at its largest batch, before their captures."""
        if self.fused_dit:
            self.default_modulations = self._modulations_at(self._time_points(DEFAULT_STEPS))
        self.graphs = Graphs(self.device, capture)
        self.batch_buckets = batch_buckets(min(max_batch, GRAPH_BATCH))
        self.window_lengths = sorted(lengths)
        speaker = next(iter(self.speakers.values()))
        warmed = set()
        for batch in reversed(self.batch_buckets):
            for frames in reversed(self.window_lengths):
                if not _static(batch, frames):
                    continue
                on = {"device": self.device}
                inputs = {
                    "codes": torch.zeros(batch, frames, dtype=torch.int64, **on),
                    "noise": torch.zeros(batch, frames * self.repeats, self.mel_dim, **on),
                    "offsets": torch.zeros(batch, dtype=torch.int64, **on),
                    "lengths": torch.full((batch,), frames * self.repeats, **on),
                    "ref": speaker["ref"].expand(batch, -1).clone(),
                    "ref_dropped": speaker["ref_dropped"].expand(batch, -1).clone(),
                    "cond": speaker["cond"].expand(batch, -1).clone(),
                    "guidance": torch.zeros(batch, **on),
                }
                begin = functools.partial(self._begin, steps=DEFAULT_STEPS)
                # The state's buffers, made by an eager begin (its warm-up too).
                solve = _cloned(begin(**inputs))
                key, warm = (frames, batch, DEFAULT_STEPS), frames not in warmed
                self.graphs.add((*key, "begin"), _into(solve, begin), inputs, warm_up=False)
                self.graphs.add((*key, "step"), functools.partial(self._step, solve), {}, warm)
                self.graphs.add((*key, "end"), functools.partial(self._end, solve), {}, warm)
                warmed.add(frames)
        self.graphs.synchronize()


def _rk4_points(start: torch.Tensor, end: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The times an RK4 step from `start` to `end` evaluates the DiT at, as transformers'
    `RungeKutta4ODESolver` computes them."""
    step = end - start
    return start, start + step * (1 / 3), start + step * (2 / 3), end


def _static(batch: int, frames: int) -> bool:
    """Whether `prepare` makes a static window of `frames` codes at batch bucket `batch`:
    up to GRAPH_CODES codes in all, one window always."""
    return batch == 1 or batch * frames <= GRAPH_CODES


def _cloned(state: dict) -> dict:
    """`state` (tensors, or dicts of them) in buffers of its own."""
    return {k: _cloned(v) if isinstance(v, dict) else v.clone() for k, v in state.items()}


def _into(state: dict, make) -> Callable[..., None]:
    """`make(**inputs)`, a state like `state`, copied into `state`'s buffers."""

    def fill(into: dict, values: dict) -> None:
        for name, value in values.items():
            if isinstance(value, dict):
                fill(into[name], value)
            else:
                into[name].copy_(value)

    return lambda **inputs: fill(state, make(**inputs))


def _codes(mel_frames: float, repeats: int) -> float:
    """Mel frames as the codes that cover them."""
    return mel_frames if mel_frames == math.inf else math.ceil(mel_frames / repeats)
