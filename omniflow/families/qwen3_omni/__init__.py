"""Qwen3-Omni (`model_type` qwen3_omni_moe): an MoE thinker (with its audio and vision
towers) streaming into an MoE talker whose code predictor fills each 12.5 Hz frame's
codebooks, decoded by the causal ConvNet code2wav.

Run-time half: `thinker_talker` (the thinker and the talker with its code predictor as
components of the transformers `ar` backend, the adapters of the edges between the
stages), `towers` (the thinker's audio and vision towers for the transformers `encoder`
backend), `code2wav` (the vocoder as a `Decoder`); `checkpoints` (the tiny checkpoint and
the reference run), `scaled` (the real-size random-weight one). Torch-free: `costs` (the
talker's and code2wav's cost formulas), and this module, which also holds the layout facts
of the published checkpoint that those share.
"""

from __future__ import annotations

from pathlib import Path

from omniflow.families.family import Family, Part, TinyModel, local_config
from omniflow.families.qwen2_5_omni import omni_adapters, omni_stages, thinker_parts
from omniflow.families.qwen3_omni.costs import cost

_HERE = __name__

ARCHITECTURE = "qwen3_omni_moe"
REAL_MODEL = "Qwen/Qwen3-Omni-30B-A3B-Instruct"

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


def vision_hidden_width(config) -> int:
    """The vision tower's `hidden` width: its merged embeddings and, beside them, the
    features of each of its `deepstack_visual_indexes` layers, all `out_hidden_size` wide
    (the thinker adds those to its first decoder layers' outputs at the visual positions)."""
    return config["out_hidden_size"] * (1 + len(config.get("deepstack_visual_indexes") or ()))


def speakers(path: str | Path) -> tuple[str, ...] | None:
    """The speakers of a local Qwen3-Omni checkpoint (its talker's `speaker_id`), named as
    `generate` takes them ("Ethan"; it lowers the case); None for any other checkpoint."""
    layout = local_config(path, ARCHITECTURE)
    if layout is None:
        return None
    names = (layout.get("talker_config") or {}).get("speaker_id") or {}
    return tuple(sorted(name.capitalize() for name in names)) or None


FAMILY = Family(
    name="qwen3_omni",
    doc=__doc__,
    architectures=(ARCHITECTURE,),
    cost=cost,
    parts={
        **thinker_parts("moe_lm", hidden_width=vision_hidden_width),
        "talker": Part(
            "moe_lm",
            ("talker_config", "text_config"),
            class_level=1,
            keep=("code_predictor_config",),
            extras={
                "text_projection": ("talker.text_projection.",),
                "hidden_projection": ("talker.hidden_projection.",),
            },
            # Its prompt: the thinker prompt's user turns, then 9 rows of its own, 3 of them
            # the thinker's `<|im_start|>assistant\n` (thinker_talker._ASSISTANT_ROWS).
            added_positions=6,
        ),
        "code2wav": Part(
            "vocoder",
            ("code2wav_config",),
            weights=("code2wav.",),
            defaults={"sample_rate": 24000},
            carries_state=True,
        ),
    },
    **omni_stages(_HERE, "code2wav"),
    adapters=omni_adapters(
        "qwen3_omni",
        _HERE,
        "thinker accept-layer hidden states and embeddings -> the talker's conditioning",
        "talker frames (16 codebooks) -> code2wav codes (drops any outside the codebook)",
    ),
    speakers=f"{_HERE}:speakers",
    tiny=(
        TinyModel(
            "qwen3-omni",
            "Qwen3OmniMoeForConditionalGeneration: MoE thinker (with audio and vision "
            "towers), MoE talker with its 5-layer code predictor over 16 codebooks, causal "
            "ConvNet code2wav (x1920, 24 kHz)",
            ("tokenizer", "model", "weights", "save"),
            f"{_HERE}.checkpoints:build_tiny",
            counterparts=(REAL_MODEL,),
        ),
    ),
    scaled={REAL_MODEL: f"{_HERE}.scaled:build_scaled"},
)
