"""A codec-LM text-to-speech model (`model_index.json` `_class_name` OmniflowTinyTTS): a
Qwen3 causal LM prompted with text and a speaker token, speaking one codebook of a DAC
codec, which a vocoder stage decodes (`omniflow.families.audio_codecs`). A second TTS
family beside Qwen3-TTS (`omniflow.families.qwen3_tts`), built only as `tiny:tts`:
graphs/tts.omni runs it by that name.

Run-time half: `codec_lm` (the LM as a component of the transformers `ar` backend, the
speakers the index lists); `checkpoints` (tiny, reference).
"""

from __future__ import annotations

from omniflow.families.family import Family, TinyModel

_HERE = __name__

FAMILY = Family(
    name="codec_tts",
    doc=__doc__,
    architectures=("OmniflowTinyTTS",),
    runtime={("ar", "transformers"): f"{_HERE}.codec_lm:load"},
    speakers=f"{_HERE}.codec_lm:speakers",
    tiny=(
        TinyModel(
            "tts",
            "codec-LM TTS: Qwen3ForCausalLM talker over text + codec tokens, DacModel "
            "code2wav (1 codebook, 24 kHz, 12.5 frames/s)",
            ("tokenizer", "talker", "code2wav", "index"),
            # No hub id: it stands in for no published model (graphs/tts.omni names it).
            f"{_HERE}.checkpoints:build_tiny",
        ),
    ),
)
