"""Qwen3-TTS's cost rule (torch-free; the descriptor's `cost`): Qwen3-Omni's for the talker
and the decoder (the same architectures, `omniflow.families.qwen3_omni.costs`), and
`VoiceEncoderCost` for the `voice_encoder` part, a Base checkpoint's ECAPA speaker encoder
with the speech tokenizer's Mimi encoder beside it.

The speaker encoder is counted from its config (`speaker_encoder_config`: convolutions of
`enc_channels`, Res2Net blocks, attentive pooling, the x-vector projection); the Mimi
encoder's config lives in another file (`speech_tokenizer/config.json`), so it is counted
as the published tokenizer's encoder (`MIMI_ENCODER_PARAMS`). A checkpoint without a
speaker encoder (CustomVoice, VoiceDesign) has nothing to load: it costs nothing.
"""

from __future__ import annotations

from omniflow.catalog.components import ComponentConfig
from omniflow.catalog.costs import NONE, Count, Estimator, Shape, conv, linear
from omniflow.families.qwen3_omni.costs import cost as codec_cost
from omniflow.families.qwen3_tts.config import SPEAKER_ENCODER_DEFAULTS

# The published 12 Hz tokenizer's Mimi encoder: a SEANet convolution stack, an 8-layer
# transformer of width 512 and the split residual quantizer's projections and codebooks.
MIMI_ENCODER_PARAMS = 48_000_000
ARCH = "qwen3_tts"
# Mel frames a second of 24 kHz audio makes (hop 256), and the longest clip a server takes.
MEL_FRAMES_PER_SECOND = 24000 // 256
MAX_CLIP_SECONDS = 60


def speaker_encoder(c) -> Count:
    """ECAPA-TDNN: a time-delay stem, Res2Net SE blocks, multi-layer aggregation, attentive
    statistics pooling and the x-vector projection."""
    channels, kernels = c["enc_channels"], c["enc_kernel_sizes"]
    scale, se = c["enc_res2net_scale"], c["enc_se_channels"]
    count = conv(c["mel_dim"], channels[0], kernels[0])
    for width, kernel in zip(channels[1:-1], kernels[1:-1], strict=True):
        branch = width // scale
        count += 2 * conv(width, width, 1) + (scale - 1) * conv(branch, branch, kernel)
        count += conv(width, se, 1) + conv(se, width, 1)
    count += conv(sum(channels[1:-1]), channels[-1], kernels[-1])
    attention = c["enc_attention_channels"]
    count += conv(3 * channels[-1], attention, 1) + conv(attention, channels[-1], 1)
    return count + conv(2 * channels[-1], c["enc_dim"], 1)


class VoiceEncoderCost(Estimator):
    """A reference clip -> its x-vector and codes, costed per mel frame of the longest clip."""

    item = "mel frame"

    def __init__(self, cfg: ComponentConfig):
        c = {**SPEAKER_ENCODER_DEFAULTS, **cfg.config}
        count, self.width = NONE, 0  # a checkpoint that clones no voices: nothing runs
        if cfg.config.get("tts_model_type", "base") == "base":
            count = speaker_encoder(c) + linear(MIMI_ENCODER_PARAMS, 1)
            self.width = max(c["enc_channels"])
        super().__init__(cfg, count, "formula")

    def activation_bytes(self, s: Shape) -> float:
        frames = MEL_FRAMES_PER_SECOND * MAX_CLIP_SECONDS
        return s.batch * frames * 4 * self.width * s.nbytes

    def flops(self, s: Shape) -> float:
        return 2.0 * self.count.macs


def cost(cfg: ComponentConfig) -> Estimator | None:
    """A voice encoder (a Qwen3-TTS checkpoint's root config, or its speaker encoder's),
    else Qwen3-Omni's rule."""
    c = cfg.config
    if cfg.category == "audio_encoder" and ("enc_dim" in c or c.get("model_type") == ARCH):
        return VoiceEncoderCost(cfg)
    return codec_cost(cfg)
