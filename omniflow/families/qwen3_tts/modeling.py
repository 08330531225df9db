"""Qwen3-TTS's modules, from the checkpoint's config and under its own tensor names.

The talker (`talker.*` in `model.safetensors`) is a Qwen3 decoder: transformers' `Qwen3Model`
(the same layers as the reference's `Qwen3TTSTalkerDecoderLayer`: q/k RMSNorms, SwiGLU,
rotary), whose input embedding table is the codec embedding (`talker.model.codec_embedding`,
3072 ids: 2048 codes of codebook 0, then specials, languages and speakers). Beside it:
the text embedding (`talker.model.text_embedding`, the Qwen text vocabulary) and the text
projection (`talker.text_projection`, a biased two-layer SiLU MLP into the talker's
width), and `talker.codec_head`, the logits of codebook 0.

The code predictor (`talker.code_predictor.*`) is a small Qwen3 decoder that fills
codebooks 1..15 of a frame: its prefill is the talker's last hidden state and the
embedding of codebook 0's code (the talker's codec embedding), projected to its width
(`small_to_mtp_projection`, where the widths differ); then for g = 1..15 it samples code g
from `lm_head[g - 1]` and feeds `codec_embedding[g - 1](code g)`, projected.

The speaker encoder (`speaker_encoder.*`, Base checkpoints only) is an ECAPA-TDNN over a
128-bin log-mel spectrogram at 24 kHz; its x-vector (2048 wide for 1.7B, the talker's
width) is the speaker row of a voice-clone prompt. Its modules are transformers'
`ECAPA_TimeDelayNet` (Qwen2.5-Omni's, the reference's same code).
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import torch
from torch import nn

from omniflow.backends.static_decode import summed_codebooks
from omniflow.dtypes import cast_model
from omniflow.families.qwen3_tts.config import (
    CODE_PREDICTOR_DEFAULTS,
    SPEAKER_ENCODER_DEFAULTS,
    TALKER_DEFAULTS,
    Qwen3TTSError,
    TTSConfig,
    qwen3_config,
)
from omniflow.runtime.readback import upload

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# The one rename between the checkpoint and transformers' Qwen3Model: its input table.
_TALKER_RENAMES = {"model.codec_embedding.weight": "model.embed_tokens.weight"}


# --- weights ----------------------------------------------------------------------------


def local_file(root: str, name: str) -> str | None:
    """`name` in the checkpoint `root` (a folder, or a hub id in the local cache), or None."""
    from transformers.utils import cached_file

    return cached_file(
        root,
        name,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
    )


def read_tensors(root: str, prefix: str, subfolder: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint whose name starts with `prefix`, prefix removed (one
    `model.safetensors` or the shards its index lists)."""
    from safetensors import safe_open

    base = f"{subfolder}/" if subfolder else ""
    index = local_file(root, base + WEIGHTS_INDEX)
    if index is not None:
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = [WEIGHTS]
    out = {}
    for name in files:
        path = local_file(root, base + name)
        if path is None:
            raise Qwen3TTSError(f"{root}: no {base + name}")
        with safe_open(path, "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no iteration)
                if key.startswith(prefix):
                    out[key[len(prefix) :]] = f.get_tensor(key)
    return out


def load_weights(module: nn.Module, tensors: dict[str, torch.Tensor], what: str, renames=None):
    """Copy `tensors` into `module`'s parameters and persistent buffers, every one of them;
    a missing or extra tensor, or one of another shape, is an error naming it."""
    renames = renames or {}
    tensors = {renames.get(k, k): v for k, v in tensors.items()}
    own = module.state_dict()
    missing = sorted(set(own) - set(tensors))
    extra = sorted(set(tensors) - set(own))
    if missing or extra:
        raise Qwen3TTSError(
            f"{what}: the checkpoint's tensors do not fit the architecture "
            f"(missing {missing[:5]}, unexpected {extra[:5]})"
        )
    for key, value in tensors.items():
        if tuple(value.shape) != tuple(own[key].shape):
            raise Qwen3TTSError(
                f"{what}: tensor {key} is {list(value.shape)}, the config makes {list(own[key].shape)}"
            )
    module.load_state_dict(tensors, strict=True)


def torch_dtype(config: TTSConfig, dtype) -> torch.dtype:
    """The stage's dtype ("auto": the checkpoint's)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, config.dtype, torch.float32)


# --- the talker -------------------------------------------------------------------------


class TextProjection(nn.Module):
    """`Qwen3TTSTalkerResizeMLP`: text width -> text width -> talker width, biased, SiLU."""

    def __init__(self, width: int, hidden: int, out: int, act: str):
        from transformers.activations import ACT2FN

        super().__init__()
        self.linear_fc1 = nn.Linear(width, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, out, bias=True)
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class CodePredictor(nn.Module):
    """Codebooks 1..G-1 of a frame from the talker's hidden state and codebook 0's code."""

    def __init__(self, dims: dict, talker_hidden: int):
        from transformers import Qwen3Model

        super().__init__()
        config = qwen3_config(dims, CODE_PREDICTOR_DEFAULTS)
        self.groups = int(dims.get("num_code_groups", 32))
        self.model = Qwen3Model(config)
        del self.model.embed_tokens  # its inputs are the codec embeddings below
        self.model.codec_embedding = nn.ModuleList(
            [nn.Embedding(config.vocab_size, talker_hidden) for _ in range(self.groups - 1)]
        )
        self.lm_head = nn.ModuleList(
            [
                nn.Linear(config.hidden_size, config.vocab_size, bias=False)
                for _ in range(self.groups - 1)
            ]
        )
        if config.hidden_size != talker_hidden:
            self.small_to_mtp_projection = nn.Linear(talker_hidden, config.hidden_size, bias=True)
        else:
            self.small_to_mtp_projection = nn.Identity()

    def forward_step(self, embeds: torch.Tensor, cache, start: int) -> torch.Tensor:
        """Last hidden states `[B, L, H]` of `embeds` (talker-wide) at positions start.."""
        out = self.model(
            inputs_embeds=self.small_to_mtp_projection(embeds),
            position_ids=_causal_positions(len(embeds), embeds.shape[1], start, embeds.device),
            cache=cache,
            use_cache=True,
        )
        return out.last_hidden_state


def _causal_positions(batch: int, length: int, start: int, device) -> torch.Tensor:
    return (torch.arange(length, device=device) + start)[None].expand(batch, -1)


class Talker(nn.Module):
    """`Qwen3TTSTalkerForConditionalGeneration`'s modules, under its tensor names."""

    def __init__(self, config: TTSConfig):
        from transformers import Qwen3Model

        super().__init__()
        dims = config.talker
        qwen3 = qwen3_config(dims, TALKER_DEFAULTS)
        text_hidden = int(dims.get("text_hidden_size", TALKER_DEFAULTS["text_hidden_size"]))
        text_vocab = int(dims.get("text_vocab_size", TALKER_DEFAULTS["text_vocab_size"]))
        self.model = Qwen3Model(qwen3)  # embed_tokens: the codec embedding
        self.model.text_embedding = nn.Embedding(text_vocab, text_hidden)
        self.text_projection = TextProjection(
            text_hidden, text_hidden, qwen3.hidden_size, qwen3.hidden_act
        )
        self.codec_head = nn.Linear(qwen3.hidden_size, qwen3.vocab_size, bias=False)
        self.code_predictor = CodePredictor(config.code_predictor, qwen3.hidden_size)
        self.config = qwen3
        self.groups = config.layout.num_code_groups
        self._fixed_text: dict[tuple[int, ...], torch.Tensor] = {}  # `fixed_text`'s
        if self.code_predictor.groups != self.groups:
            raise Qwen3TTSError(
                f"the talker has {self.groups} code groups, its code predictor "
                f"{self.code_predictor.groups}"
            )

    @property
    def codec_embedding(self) -> nn.Embedding:
        return self.model.embed_tokens

    def text(self, ids) -> torch.Tensor:
        """Projected text embeddings `[L, D]` of text token ids."""
        ids = upload(ids, self.codec_head.weight.device).reshape(-1)
        return self.text_projection(self.model.text_embedding(ids))

    def fixed_text(self, ids: tuple[int, ...]) -> torch.Tensor:
        """`text(ids)` for ids that every prompt has (the special tokens, the role):
        computed once."""
        rows = self._fixed_text.get(ids)
        if rows is None:
            rows = self._fixed_text[ids] = self.text(list(ids))
        return rows

    def codec(self, ids) -> torch.Tensor:
        """Codec embeddings `[L, D]` of talker ids (codebook 0 and the specials)."""
        ids = upload(ids, self.codec_head.weight.device).reshape(-1)
        return self.codec_embedding(ids)

    def frame_embeds(self, codes: torch.Tensor) -> torch.Tensor:
        """`[N, D]`: each frame's input to the talker, the sum of its G codebooks'
        embeddings (codebook 0 in the talker's table, g >= 1 in the code predictor's)."""
        return summed_codebooks(
            self.codec_embedding, self.code_predictor.model.codec_embedding, codes
        )

    def state_dict_renames(self) -> dict[str, str]:
        return dict(_TALKER_RENAMES)


def load_talker(root: str, config: TTSConfig, dtype, device: str) -> Talker:
    """The talker and its code predictor, with the checkpoint's weights, in eval mode. Made
    in the dtype it runs in, so that a bf16 checkpoint's tensors are copied, not cast to
    float32 on the host and back (the 1.7B talker loaded to the host in bf16: 4.5 -> 1.6 s at
    one thread, 3.2 -> 0.9 s at two, on a 2-core machine)."""
    target = torch_dtype(config, dtype)
    with torch.device("meta"):
        talker = Talker(config).to(target)
    talker = talker.to_empty(device="cpu")
    load_weights(talker, read_tensors(root, "talker."), f"{root} talker", _TALKER_RENAMES)
    _reset_rotary(talker)  # float32, as transformers keeps them in a bf16 model
    return cast_model(talker, target, device).eval()


def _reset_rotary(module: nn.Module) -> None:
    """Recompute the rotary tables: non-persistent buffers, so not in the checkpoint, and
    left uninitialised by a construction on the meta device."""
    for sub in module.modules():
        if hasattr(sub, "compute_default_rope_parameters") and hasattr(sub, "inv_freq"):
            inv_freq, scaling = sub.compute_default_rope_parameters(sub.config)
            sub.inv_freq = nn.Buffer(inv_freq, persistent=False)
            sub.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)
            sub.attention_scaling = scaling


# --- the speaker encoder ------------------------------------------------------------------


def speaker_encoder_config(config: TTSConfig) -> SimpleNamespace:
    dims = {**SPEAKER_ENCODER_DEFAULTS, **(config.speaker_encoder or {})}
    return SimpleNamespace(**dims)


def build_speaker_encoder(config: TTSConfig) -> nn.Module:
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import ECAPA_TimeDelayNet

    return ECAPA_TimeDelayNet(speaker_encoder_config(config))


def load_speaker_encoder(root: str, config: TTSConfig, dtype, device: str) -> nn.Module:
    encoder = build_speaker_encoder(config)
    load_weights(encoder, read_tensors(root, "speaker_encoder."), f"{root} speaker encoder")
    return encoder.to(device=device, dtype=torch_dtype(config, dtype)).eval()


# The reference's `extract_speaker_embedding`: a 24 kHz log-mel (librosa's Slaney mel filters,
# Hann window, magnitude with 1e-9 inside the square root, natural log clamped at 1e-5).
MEL = {"n_fft": 1024, "num_mels": 128, "sampling_rate": 24000, "hop": 256, "win": 1024}


def _mel_filters(device) -> torch.Tensor:
    """`librosa.filters.mel(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000)` (Slaney
    scale and norm), through transformers' equivalent."""
    from transformers.audio_utils import mel_filter_bank

    bank = mel_filter_bank(
        num_frequency_bins=MEL["n_fft"] // 2 + 1,
        num_mel_filters=MEL["num_mels"],
        min_frequency=0.0,
        max_frequency=MEL["sampling_rate"] / 2,
        sampling_rate=MEL["sampling_rate"],
        norm="slaney",
        mel_scale="slaney",
    )
    return torch.from_numpy(bank.T).float().to(device)


def log_mel(audio: torch.Tensor) -> torch.Tensor:
    """`[frames, 128]` log-mel of 24 kHz mono `audio` `[samples]` (float32)."""
    n_fft, hop, win = MEL["n_fft"], MEL["hop"], MEL["win"]
    pad = (n_fft - hop) // 2
    y = torch.nn.functional.pad(audio.float()[None, None], (pad, pad), mode="reflect")[0]
    spec = torch.stft(
        y,
        n_fft,
        hop_length=hop,
        win_length=win,
        window=torch.hann_window(win, device=audio.device),
        center=False,
        pad_mode="reflect",
        normalized=False,
        onesided=True,
        return_complex=True,
    )
    magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    mel = torch.matmul(_mel_filters(audio.device), magnitude)
    return torch.log(torch.clamp(mel, min=1e-5))[0].transpose(0, 1)


def min_speaker_samples(config: TTSConfig) -> int:
    """The fewest 24 kHz samples the speaker encoder takes: its time-delay layers pad their
    input by reflection, (kernel - 1) x dilation / 2 frames each side, which needs more mel
    frames than that (1280 samples, 53 ms, for every published checkpoint)."""
    dims = speaker_encoder_config(config)
    reach = max(
        (kernel - 1) * dilation // 2
        for kernel, dilation in zip(dims.enc_kernel_sizes, dims.enc_dilations, strict=True)
    )
    n_fft, hop = MEL["n_fft"], MEL["hop"]
    return hop * reach + n_fft - 2 * ((n_fft - hop) // 2)


@torch.inference_mode()
def speaker_embedding(encoder: nn.Module, audio: torch.Tensor) -> torch.Tensor:
    """The x-vector `[enc_dim]` of 24 kHz mono audio."""
    weight = next(encoder.parameters())
    mel = log_mel(audio.to(weight.device))[None].to(weight.dtype)
    return encoder(mel)[0]


# --- resampling -----------------------------------------------------------------------------


# Output samples resampled at a time: what a block's kernel holds (each sample's window of
# 2 x width + 1 taps in float64) stays tens of MB, however long the clip.
RESAMPLE_BLOCK = 1 << 14


def resample(audio: torch.Tensor, rate: int, target: int) -> torch.Tensor:
    """`audio` at `rate` Hz as `target` Hz: a Kaiser-windowed sinc (beta 8.6, 32 zero
    crossings each side) at the lower Nyquist rate, `RESAMPLE_BLOCK` output samples at a
    time. The reference resamples with librosa (soxr): from 16 kHz, a two-tone signal agrees
    within 8.5e-6 away from the ends, 3.5e-3 in their first and last few ms."""
    if rate == target:
        return audio
    g = math.gcd(rate, target)
    up, down = target // g, rate // g
    cutoff = min(1.0, target / rate)
    width = math.ceil(32 / cutoff)
    frames = -(-len(audio) * target // rate)
    beta = 8.6
    norm = torch.special.i0(torch.tensor(beta).double())
    offsets = torch.arange(-width, width + 1, dtype=torch.float64)
    padded = torch.nn.functional.pad(audio.double(), (width, width))
    out = []
    for first in range(0, frames, RESAMPLE_BLOCK):
        index = torch.arange(first, min(first + RESAMPLE_BLOCK, frames))
        start = index * down // up
        phase = (index * down % up).double() / up
        t = phase[:, None] - offsets[None]
        window = torch.special.i0(beta * torch.sqrt(torch.clamp(1 - (t / (width + 1)) ** 2, min=0)))
        kernel = cutoff * torch.sinc(cutoff * t) * window / norm
        gathered = padded.unfold(0, 2 * width + 1, 1)[start]
        out.append((gathered * kernel).sum(-1))
    return torch.cat(out).to(audio.dtype) if out else audio.new_zeros(0)
