"""Qwen2.5-Omni (`model_type` qwen2_5_omni): a thinker LLM (with its audio and vision
towers) streaming into a talker LLM streaming codec codes into token2wav (a DiT that turns
codes into mel frames in blocks, then BigVGAN).

Run-time half: `thinker_talker` (both LMs as components of the transformers `ar` backend,
the adapters of the edges between them, the speakers), `token2wav` and `token2wav_dit`
(the vocoder as a `Decoder`); `checkpoints` (tiny, reference, real size).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from omniflow.families.family import AdapterSpec, Family, Part, TinyModel
from omniflow.families.knobs import USE_AUDIO_IN_VIDEO

_HERE = __name__


def token2wav_samples_per_frame(config: Mapping[str, Any]) -> int:
    """The DiT emits `repeats` mel frames per code, BigVGAN upsamples each."""
    mel_per_code = config["dit_config"].get("repeats", 1)
    return mel_per_code * math.prod(config["bigvgan_config"]["upsample_rates"])


def token2wav_block_grid(config: Mapping[str, Any]) -> tuple[int, int]:
    """(codes per block, codes of lookahead): token2wav's DiT attends within blocks of mel
    frames and, in its look-ahead layers, one block ahead: windows start on block boundaries
    (as blocks sit in the whole utterance) and see one block more ahead than its passes do."""
    dit = config["dit_config"]
    block, repeats = dit["block_size"], dit["repeats"]
    ahead = (len(dit["look_ahead_layers"]) + 1) * block
    return block // math.gcd(block, repeats), math.ceil(ahead / repeats)


def thinker_parts(kind: str, **visual) -> dict[str, Part]:
    """A Qwen omni thinker (a `kind` LM) and its audio and vision towers, parts of their own
    (encoder stages run them); `visual`: more of the vision tower's `Part`."""
    return {
        "thinker": Part(
            kind,
            ("thinker_config", "text_config"),
            class_level=1,
            keep=("audio_config", "vision_config"),
        ),
        "audio_tower": Part(
            "audio_encoder", ("thinker_config", "audio_config"), weights=("thinker.audio_tower.",)
        ),
        "visual": Part(
            "vision_encoder",
            ("thinker_config", "vision_config"),
            weights=("thinker.visual.",),
            **visual,
        ),
    }


def omni_stages(family: str, vocoder: str) -> dict[str, Any]:
    """What a Qwen omni family's `Family` says of its stages, its modules in the package
    `family` (`thinker_talker`, `towers` and the `vocoder`'s): the loaders of its run-time
    half and the thinker's media inputs, the vision tower's check of its pictures (its
    processor is Qwen2-VL's) and the towers' count of a request's media."""
    return {
        "admission": "omniflow.families.qwen2_5_vl:image_admission",
        "media_tokens": f"{family}.towers:media_tokens",
        "runtime": {
            ("ar", "transformers"): f"{family}.thinker_talker:load",
            ("vocoder", "transformers"): f"{family}.{vocoder}:load",
            ("encoder", "transformers"): f"{family}.towers:load",
        },
        # The thinker takes the audio tower's embeddings beside the vision tower's (`embeds`),
        # and the processor's `use_audio_in_video` (a video's audio track interleaved).
        "stage_inputs": {"ar": {"audio_embeds": ("hidden",)}},
        "stage_params": {"ar": {"use_audio_in_video": USE_AUDIO_IN_VIDEO}},
    }


def omni_adapters(
    prefix: str, family: str, conditioning: str, codes: str
) -> dict[str, AdapterSpec]:
    """A Qwen omni family's two adapters, `prefix.thinker_to_talker` and
    `prefix.talker_to_code2wav`, in its module `family.thinker_talker`; `conditioning` and
    `codes` say what each does."""
    return {
        f"{prefix}.thinker_to_talker": AdapterSpec(
            "hidden",
            "hidden",
            f"{family}.thinker_talker:thinker_to_talker",
            conditioning,
            # Per position: a hidden state, input embedding and a prompt/reply role row.
            source_rows=3,
            with_prompt=True,
        ),
        f"{prefix}.talker_to_code2wav": AdapterSpec(
            "codes", "codes", f"{family}.thinker_talker:talker_to_code2wav", codes
        ),
    }


FAMILY = Family(
    name="qwen2_5_omni",
    doc=__doc__,
    architectures=("qwen2_5_omni",),
    parts={
        **thinker_parts("decoder_lm"),
        "talker": Part(
            "decoder_lm",
            ("talker_config",),
            extras={"thinker_to_talker_proj": ("talker.thinker_to_talker_proj.",)},
            # The talker emits one code per step from a single codebook.
            defaults={"num_code_groups": 1},
            # Its prompt: the thinker's, then the speaker's row and the first reply's.
            added_positions=2,
        ),
        "token2wav": Part(
            "vocoder",
            ("token2wav_config",),
            weights=("token2wav.",),
            defaults={"sample_rate": 24000, "num_code_groups": 1},
            # transformers runs token2wav in float32 whatever the checkpoint's dtype.
            dtype="float32",
            samples_per_frame=token2wav_samples_per_frame,
            block_grid=token2wav_block_grid,
        ),
    },
    **omni_stages(_HERE, "token2wav"),
    adapters=omni_adapters(
        "qwen_omni",
        _HERE,
        "thinker hidden states and token embeddings -> talker input embeddings",
        "talker codec tokens -> token2wav codes (drops control tokens)",
    ),
    speakers=f"{_HERE}.thinker_talker:speakers",
    tiny=(
        TinyModel(
            "qwen2.5-omni",
            "Qwen2_5OmniForConditionalGeneration: thinker (with audio and vision towers), "
            "talker and token2wav (DiT + BigVGAN), with spk_dict.pt",
            ("tokenizer", "model", "weights", "speakers", "save"),
            f"{_HERE}.checkpoints:build_tiny",
            counterparts=("Qwen/Qwen2.5-Omni-7B", "Qwen/Qwen2.5-Omni-3B"),
        ),
    ),
    scaled={"Qwen/Qwen2.5-Omni-7B": f"{_HERE}.checkpoints:build_scaled_omni"},
)
