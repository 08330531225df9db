"""Qwen3-TTS-12Hz (`model_type` qwen3_tts): a Qwen3 talker with its own text embedding and a
code predictor over 16 codebooks per 12.5 Hz frame, decoded by its speech tokenizer's
causal decoder; the Base (voice clone) checkpoints add a speaker encoder. Each checkpoint
does one task (`tts_model_type`): CustomVoice (named speakers), VoiceDesign (a voice
described in words) or Base (a clone of reference audio).

Run-time half:

- `config`: the checkpoint's `config.json` and `speech_tokenizer/config.json`, read.
- `modeling`: the talker, the code predictor, the ECAPA speaker encoder and its mel front
  end, weights loaded from the checkpoint's own tensor names.
- `speech_tokenizer`: the tokenizer's decoder (16 codebooks -> 24 kHz audio, causal) and
  its Mimi encoder (reference audio -> codes, for voice cloning).
- `prompt`: the talker's prompt for CustomVoice, VoiceDesign and Base.
- `talker`: the transformers `ar` backend's component (the talker stage).
- `code2wav`: the vocoder backend's decoder (the code2wav stage).
- `voices`: a reference clip encoded once into a clone's prompt (x-vector and codes): the
  `voice_encoder` stage's model (an `encoder` stage); the family's admission checks.
- `reference`: the unsplit generation the staged pipeline is compared against.
- `checkpoints`: tiny random-weight checkpoints in the real layout, and real-size ones.

This module also reads what admission needs from a local checkpoint, torch-free.
"""

from __future__ import annotations

from pathlib import Path

from omniflow.families.family import Family, Part, TinyModel, local_config
from omniflow.families.qwen3_tts.costs import cost
from omniflow.ir.kinds import ParamSpec

_HERE = __name__
ARCHITECTURE = "qwen3_tts"
# The published checkpoints, by the task each does (`tts_model_type`).
REAL_MODELS = {
    "customvoice": "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice",
    "voicedesign": "Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign",
    "base": "Qwen/Qwen3-TTS-12Hz-1.7B-Base",
}
TASKS = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}
_LABELS = {"customvoice": "CustomVoice", "voicedesign": "VoiceDesign", "base": "Base, voice clone"}


def checkpoint_config(path: str | Path) -> dict | None:
    """A local checkpoint's config.json if it is a Qwen3-TTS one, else None."""
    return local_config(path, ARCHITECTURE)


def clones_voices(path: str | Path) -> bool:
    """`Family.voices`: whether a local checkpoint is a Base one, which clones voices."""
    layout = checkpoint_config(path)
    return layout is not None and TASKS.get(layout.get("tts_model_type", "")) == "Base"


def speakers(path: str | Path) -> tuple[str, ...] | None:
    """The named speakers of a local CustomVoice checkpoint (its talker's `spk_id`), as
    Qwen's model card names them ("Vivian"; the talker takes any letter case); None for
    any other checkpoint."""
    layout = checkpoint_config(path)
    if layout is None:
        return None
    names = (layout.get("talker_config") or {}).get("spk_id") or {}
    return tuple(name.title() for name in names) or None


FAMILY = Family(
    name="qwen3_tts",
    doc=__doc__,
    architectures=(ARCHITECTURE,),
    # Its talker (with the code predictor) and its decoder are Qwen3-Omni's architectures.
    cost=cost,
    parts={
        "talker": Part(
            "decoder_lm",
            ("talker_config",),
            extras={
                "text_embedding": ("talker.model.text_embedding.",),
                "text_projection": ("talker.text_projection.",),
                # (The code predictor is in the formula: its `code_predictor_config`.)
            },
        ),
        # Only the voice-cloning (Base) checkpoints carry a speaker encoder; the speech
        # tokenizer's Mimi encoder beside it encodes the reference's codes.
        "voice_encoder": Part(
            "audio_encoder", ("speaker_encoder_config?",), weights=("speaker_encoder.",)
        ),
        "code2wav": Part(
            "vocoder",
            ("decoder_config",),
            file="speech_tokenizer/config.json",
            weights=("decoder.",),
            carries_state=True,
        ),
    },
    runtime={
        ("ar", "transformers"): f"{_HERE}.talker:load",
        ("vocoder", "transformers"): f"{_HERE}.code2wav:load",
        ("encoder", "transformers"): f"{_HERE}.voices:load",
    },
    speakers=f"{_HERE}:speakers",
    admission=f"{_HERE}.voices:admission",
    voices=f"{_HERE}:clones_voices",
    stage_params={
        "ar": {
            # The language spoken ("Auto", "English", ... as the checkpoint lists them).
            "language": ParamSpec((str,)),
            # The task the checkpoint must do (CustomVoice, VoiceDesign, Base; "": its own).
            "task_type": ParamSpec((str,)),
            # A voice clone from the speaker embedding alone (else with the reference's codes).
            "x_vector_only_mode": ParamSpec((bool,)),
            # Whether the whole text goes into the prompt (unset: the task's default).
            "non_streaming_mode": ParamSpec((bool,)),
        }
    },
    stage_inputs={
        "ar": {
            # CustomVoice's style instruction, or VoiceDesign's voice description.
            "instructions": ("text",),
            # A voice clone's voice prompt (`voice_encoder`'s `voice`), and its transcript.
            "ref_audio": ("text", "audio"),
            "ref_text": ("text",),
        },
        # The voice encoder's reference: a file path, data: URI or base64 of an audio
        # file, samples, or a voice prompt made before (passed on as it is).
        "encoder": {"ref_audio": ("text", "audio")},
    },
    # The voice encoder's voice prompt (x-vector and codes, `voices.encode_prompt`).
    stage_outputs={"encoder": {"voice": "text"}},
    # The talker's prompt holds the instruction and a clone's transcript beside the text.
    prompt_inputs={"ar": ("instructions", "ref_text")},
    tiny=tuple(
        TinyModel(
            f"qwen3-tts-{task}",
            f"Qwen3-TTS-12Hz ({_LABELS[task]}) in the published layout: talker (Qwen3 decoder, "
            "16 code groups) with its code predictor"
            + (" and speaker encoder" if task == "base" else "")
            + ", 12 Hz speech tokenizer (Mimi encoder, causal decoder, 1920 samples a frame)",
            ("tokenizer", "talker", "speech_tokenizer"),
            f"{_HERE}.checkpoints:build_tiny_{task}",
            counterparts=(real,),
        )
        for task, real in REAL_MODELS.items()
    ),
    scaled={real: f"{_HERE}.checkpoints:build_scaled_{task}" for task, real in REAL_MODELS.items()},
)
