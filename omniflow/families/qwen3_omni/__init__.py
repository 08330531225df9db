"""Qwen3-Omni (`model_type` qwen3_omni_moe): an MoE thinker (with its audio and vision
towers) streaming into an MoE talker whose code predictor fills each 12.5 Hz frame's
codebooks, decoded by the causal ConvNet code2wav.

This module is the torch-free half: the layout facts of the published checkpoint that the
tiny and real-size builders and the run-time half share, and the dotted paths into the
run-time half, which an executor imports only when a stage loads such a checkpoint:

- `thinker_talker`: the thinker and the talker (with its code predictor) as components of
  the transformers `ar` backend, and the adapters of the edges between the stages;
- `code2wav`: the code2wav ConvNet as a `Decoder` of the vocoder backend;
- `checkpoints`: the tiny checkpoint and the reference run; `scaled`: the real-size one.

The compiler knows the published config (parts, costs, placement) from the model catalog.
"""

from __future__ import annotations

import json
from pathlib import Path

ARCHITECTURE = "qwen3_omni_moe"
REAL_MODEL = "Qwen/Qwen3-Omni-30B-A3B-Instruct"
TINY_MODEL = "qwen3-omni"

_HERE = __name__
# (stage kind, backend) -> the family's code for that backend.
RUNTIME = {
    ("ar", "transformers"): f"{_HERE}.thinker_talker:load",
    ("vocoder", "transformers"): f"{_HERE}.code2wav:load",
}
# The named adapters of the edges between its stages.
THINKER_TO_TALKER = f"{_HERE}.thinker_talker:thinker_to_talker"
TALKER_TO_CODE2WAV = f"{_HERE}.thinker_talker:talker_to_code2wav"
TINY_BUILD = f"{_HERE}.checkpoints:build_tiny"
SCALED_BUILD = f"{_HERE}.scaled:build_scaled"

# Qwen3-Omni's special tokens after Qwen's in its vocabulary (151669 .. 151675 in the real
# one): the audio markers, the talker's text-side tokens, the audio placeholder.
AUDIO_TOKENS = ("<|audio_start|>", "<|audio_end|>")
TTS_TOKENS = (
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)
# The talker's codec specials as offsets past its codebook (the published 2048 codes, then
# pad 2148, bos 2149, end of speech 2150, no-think 2155, think bos 2156, think eos 2157),
# and its speakers' codec ids (chelsie 2301, ethan 2302, aiden 2303).
CODEBOOK_OFFSETS = {
    "codec_pad_id": 100,
    "codec_bos_id": 101,
    "codec_eos_token_id": 102,
    "codec_nothink_id": 107,
    "codec_think_bos_id": 108,
    "codec_think_eos_id": 109,
}
SPEAKERS = {"chelsie": 253, "ethan": 254, "aiden": 255}
# `Qwen3OmniMoeForConditionalGeneration.generate`'s default speaker.
DEFAULT_SPEAKER = "Ethan"

_MEDIA = {
    "image": "<|vision_start|><|image_pad|><|vision_end|>",
    "video": "<|vision_start|><|video_pad|><|vision_end|>",
    "audio": "<|audio_start|><|audio_pad|><|audio_end|>",
}


def chat_template() -> str:
    """ChatML as Qwen3-Omni renders it: no default system prompt, media parts as their
    placeholders, the generation prompt `<|im_start|>assistant\\n`."""
    parts = "".join(f"{{% elif part['type'] == '{kind}' %}}{text}" for kind, text in _MEDIA.items())
    return (
        "{% for message in messages %}"
        "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}"
        f"{parts}"
        "{% endif %}"
        "{% endfor %}{% endif %}"
        "<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def speakers(path: str | Path) -> tuple[str, ...] | None:
    """The speakers of a local Qwen3-Omni checkpoint (its talker's `speaker_id`), named as
    `generate` takes them ("Ethan"; it lowers the case); None for any other checkpoint."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    layout = json.loads(config.read_text(encoding="utf-8"))
    if layout.get("model_type") != ARCHITECTURE:
        return None
    names = (layout.get("talker_config") or {}).get("speaker_id") or {}
    return tuple(sorted(name.capitalize() for name in names)) or None
