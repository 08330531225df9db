"""Qwen3-TTS-12Hz (`model_type` qwen3_tts): a Qwen3 talker with its own text embedding and a
code predictor over 16 codebooks per 12 Hz frame, decoded by its speech tokenizer's decoder;
the Base (voice clone) checkpoints add a speaker encoder.

The compiler knows its published configs (parts, costs, placement); no stage runs it yet.
"""

from __future__ import annotations

from omniflow.families.family import Family, Part

FAMILY = Family(
    name="qwen3_tts",
    doc=__doc__,
    architectures=("qwen3_tts",),
    parts={
        "talker": Part(
            "decoder_lm",
            ("talker_config",),
            extras={
                "text_embedding": ("talker.model.text_embedding.",),
                "text_projection": ("talker.text_projection.",),
                # Only the voice-cloning (Base) checkpoints carry a speaker encoder.
                "speaker_encoder": ("speaker_encoder.",),
            },
        ),
        "code2wav": Part(
            "vocoder",
            ("decoder_config",),
            file="speech_tokenizer/config.json",
            weights=("decoder.",),
        ),
    },
)
