"""Qwen3-Omni (`model_type` qwen3_omni_moe): an MoE thinker (with its audio and vision
towers) streaming into an MoE talker whose code predictor fills each 12.5 Hz frame's
codebooks, decoded by the causal ConvNet code2wav.

The compiler knows its published config (parts, costs, placement); no stage runs it yet.
"""

from __future__ import annotations

from omniflow.families.family import Family, Part

_THINKER_TOWERS = {"audio_tower": ("thinker.audio_tower.",), "visual": ("thinker.visual.",)}

FAMILY = Family(
    name="qwen3_omni",
    doc=__doc__,
    architectures=("qwen3_omni_moe",),
    parts={
        "thinker": Part(
            "moe_lm",
            ("thinker_config", "text_config"),
            class_level=1,
            keep=("audio_config", "vision_config"),
            extras=_THINKER_TOWERS,
        ),
        "talker": Part(
            "moe_lm",
            ("talker_config", "text_config"),
            class_level=1,
            keep=("code_predictor_config",),
            extras={
                "text_projection": ("talker.text_projection.",),
                "hidden_projection": ("talker.hidden_projection.",),
            },
        ),
        "code2wav": Part(
            "vocoder", ("code2wav_config",), weights=("code2wav.",), defaults={"sample_rate": 24000}
        ),
    },
)
