"""A Qwen3-TTS checkpoint's configuration, as its published files state it.

A checkpoint is a folder (or a hub id) with `config.json` (the talker, its code predictor,
the speaker encoder of a Base checkpoint, the text-side special ids), `generation_config.json`
(sampling defaults of the talker and of the code predictor, the "sub-talker"), the text
tokenizer, and `speech_tokenizer/` (`config.json`, `preprocessor_config.json`, weights).
Keys and defaults follow the `qwen_tts` reference implementation's config classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omniflow.errors import OmniflowError

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SPEECH_TOKENIZER = "speech_tokenizer"
# The checkpoint's task, by its `tts_model_type`, in the names requests use (`task_type`).
TASKS = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}
# `generate`'s defaults where generation_config.json is silent (Qwen3TTSModel's hard defaults).
SAMPLING_DEFAULTS = {
    "do_sample": True,
    "top_k": 50,
    "top_p": 1.0,
    "temperature": 0.9,
    "repetition_penalty": 1.05,
    "subtalker_dosample": True,
    "subtalker_top_k": 50,
    "subtalker_top_p": 1.0,
    "subtalker_temperature": 0.9,
    "max_new_tokens": 2048,
}
# Tokens of `<|im_start|>assistant\n` before the text, and of `<|im_end|>\n<|im_start|>assistant\n`
# after it, in the talker's input ids (the reference slices its prompts by these counts).
ROLE_TOKENS, TAIL_TOKENS = 3, 5
# Of a reference transcript `<|im_start|>assistant\n...<|im_end|>\n`: the tail is 2 tokens.
REF_TAIL_TOKENS = 2


class Qwen3TTSError(OmniflowError):
    """A Qwen3-TTS checkpoint cannot be read, or a request does not fit it."""


def _ids(value) -> list[int]:
    """A speaker id as the config gives it: an int or a one-element list."""
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


@dataclass(frozen=True)
class TalkerLayout:
    """The talker's special ids, speakers and languages (config.json's talker_config and root)."""

    codec_pad: int
    codec_bos: int
    codec_eos: int
    think: int
    nothink: int
    think_bos: int
    think_eos: int
    languages: dict[str, int]  # lower-case name -> codec id (dialects included)
    speakers: dict[str, list[int]]  # lower-case name -> codec ids
    dialects: dict[str, str]  # speaker -> the dialect language that replaces Chinese / Auto
    tts_pad: int
    tts_bos: int
    tts_eos: int
    vocab_size: int
    num_code_groups: int

    @property
    def suppressed(self) -> tuple[int, ...]:
        """What `generate` never samples: the top 1024 ids (specials), but end-of-speech."""
        return tuple(
            i for i in range(self.vocab_size - 1024, self.vocab_size) if i != self.codec_eos
        )

    def language_names(self) -> list[str]:
        """The languages a request may name, as the reference lists them: Auto, then every
        language id that is not a dialect."""
        return ["auto", *(name for name in self.languages if "dialect" not in name)]


@dataclass(frozen=True)
class TTSConfig:
    """What `config.json` says, read once."""

    raw: dict[str, Any]
    task: str  # CustomVoice, VoiceDesign or Base
    size: str | None  # tts_model_size: "1b7", "0b6"
    talker: dict[str, Any]
    code_predictor: dict[str, Any]
    speaker_encoder: dict[str, Any] | None
    layout: TalkerLayout
    dtype: str

    @classmethod
    def of(cls, raw: dict[str, Any]) -> TTSConfig:
        if raw.get("model_type") != "qwen3_tts":
            raise Qwen3TTSError(f"not a Qwen3-TTS config (model_type {raw.get('model_type')!r})")
        talker = dict(raw.get("talker_config") or {})
        kind = raw.get("tts_model_type")
        if kind not in TASKS:
            raise Qwen3TTSError(f"unknown tts_model_type {kind!r}; known: {', '.join(TASKS)}")
        layout = TalkerLayout(
            codec_pad=int(talker.get("codec_pad_id", 4196)),
            codec_bos=int(talker.get("codec_bos_id", 4197)),
            codec_eos=int(talker.get("codec_eos_token_id", 4198)),
            think=int(talker.get("codec_think_id", 4202)),
            nothink=int(talker.get("codec_nothink_id", 4203)),
            think_bos=int(talker.get("codec_think_bos_id", 4204)),
            think_eos=int(talker.get("codec_think_eos_id", 4205)),
            languages={
                k.lower(): int(v) for k, v in (talker.get("codec_language_id") or {}).items()
            },
            speakers={k.lower(): _ids(v) for k, v in (talker.get("spk_id") or {}).items()},
            dialects={
                k.lower(): str(v).lower()
                for k, v in (talker.get("spk_is_dialect") or {}).items()
                if v not in (False, None)
            },
            tts_pad=int(raw.get("tts_pad_token_id", 151671)),
            tts_bos=int(raw.get("tts_bos_token_id", 151672)),
            tts_eos=int(raw.get("tts_eos_token_id", 151673)),
            vocab_size=int(talker.get("vocab_size", 3072)),
            num_code_groups=int(talker.get("num_code_groups", 32)),
        )
        encoder = raw.get("speaker_encoder_config") if kind == "base" else None
        return cls(
            raw,
            TASKS[kind],
            raw.get("tts_model_size"),
            talker,
            dict(talker.get("code_predictor_config") or {}),
            dict(encoder or {}) if kind == "base" else None,
            layout,
            str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )


def qwen3_config(dims: dict[str, Any], defaults: dict[str, Any]):
    """transformers' `Qwen3Config` for a Qwen3-shaped decoder of the checkpoint (the talker
    or the code predictor): the layers, norms and rotary the reference's classes build.

    The talker's rotary is multimodal ("interleaved", `mrope_section`), but its three
    position rows are always equal (text only), which is the 1-D rotary exactly."""
    from transformers import Qwen3Config

    def get(key):
        return dims.get(key, defaults[key])

    return Qwen3Config(
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        intermediate_size=get("intermediate_size"),
        num_hidden_layers=get("num_hidden_layers"),
        num_attention_heads=get("num_attention_heads"),
        num_key_value_heads=get("num_key_value_heads"),
        head_dim=dims.get("head_dim", get("hidden_size") // get("num_attention_heads")),
        hidden_act=get("hidden_act"),
        max_position_embeddings=get("max_position_embeddings"),
        rms_norm_eps=get("rms_norm_eps"),
        attention_bias=get("attention_bias"),
        rope_parameters={"rope_type": "default", "rope_theta": float(get("rope_theta"))},
        tie_word_embeddings=False,
        use_sliding_window=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )


# The reference config classes' defaults (Qwen3TTSTalkerConfig, ...CodePredictorConfig).
TALKER_DEFAULTS = {
    "vocab_size": 3072,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 20,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "rope_theta": 10000,
    "text_hidden_size": 2048,
    "text_vocab_size": 151936,
}
CODE_PREDICTOR_DEFAULTS = {
    "vocab_size": 2048,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 5,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "rope_theta": 10000,
}
SPEAKER_ENCODER_DEFAULTS = {
    "mel_dim": 128,
    "enc_dim": 1024,
    "enc_channels": [512, 512, 512, 512, 1536],
    "enc_kernel_sizes": [5, 3, 3, 3, 1],
    "enc_dilations": [1, 2, 3, 4, 1],
    "enc_attention_channels": 128,
    "enc_res2net_scale": 8,
    "enc_se_channels": 128,
    "sample_rate": 24000,
}
# Qwen3TTSTokenizerV2DecoderConfig's defaults.
DECODER_DEFAULTS = {
    "codebook_size": 2048,
    "hidden_size": 1024,
    "latent_dim": 1024,
    "max_position_embeddings": 8000,
    "rope_theta": 10000,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "attention_bias": False,
    "sliding_window": 72,
    "intermediate_size": 3072,
    "hidden_act": "silu",
    "layer_scale_initial_scale": 0.01,
    "rms_norm_eps": 1e-5,
    "num_hidden_layers": 8,
    "num_quantizers": 16,
    "upsample_rates": [8, 5, 4, 3],
    "upsampling_ratios": [2, 2],
    "decoder_dim": 1536,
    "codebook_dim": 512,
}


class RequestProblem(Qwen3TTSError):
    """A request's task inputs do not fit the checkpoint; `field` names the stage parameter
    or input port at fault (task_type, language, voice, instructions, ref_audio, ref_text)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def check_task_inputs(
    config: TTSConfig,
    *,
    task_type: str | None,
    language: str | None,
    voice: str | None,
    instructions: str,
    ref_audio: bool,
    ref_text: str,
    x_vector_only: bool,
    voice_field: str = "voice",
) -> str:
    """The task a request runs, checked against what the checkpoint does (the same rules at
    admission and in the talker stage); raises RequestProblem naming the field."""
    own = config.task
    task = task_type or own
    if task != own:
        raise RequestProblem(
            f"task_type {task!r}: this checkpoint ({own}) does only {own}", "task_type"
        )
    layout = config.layout
    name = (language or "auto").lower()
    if name != "auto" and name not in layout.languages:
        names = ", ".join(n.title() for n in layout.language_names())
        raise RequestProblem(
            f"unknown language {language!r}; this model speaks {names}", "language"
        )
    if task == "CustomVoice":
        if voice and voice.lower() not in layout.speakers:
            names = ", ".join(sorted(n.title() for n in layout.speakers))
            raise RequestProblem(f"unknown voice {voice!r}; this model has {names}", voice_field)
        if instructions and config.size == "0b6":
            raise RequestProblem("the 0.6B CustomVoice model takes no instructions", "instructions")
    elif voice:
        hint = "describe the voice in `instructions`" if task == "VoiceDesign" else "give ref_audio"
        raise RequestProblem(
            f"a {task} model has no named voices (got {voice!r}); {hint}", voice_field
        )
    if task == "Base":
        if not ref_audio:
            raise RequestProblem("voice cloning (Base) needs ref_audio", "ref_audio")
        if not x_vector_only and not ref_text:
            raise RequestProblem(
                "voice cloning with the reference's codes (ICL) needs ref_text; "
                "or set x_vector_only_mode",
                "ref_text",
            )
        if instructions:
            raise RequestProblem("voice cloning (Base) takes no instructions", "instructions")
    else:  # what only a clone takes, given to a model that does not clone: not ignored
        for given, field in ((ref_audio, "ref_audio"), (ref_text, "ref_text"),
                             (x_vector_only, "x_vector_only_mode")):  # fmt: skip
            if given:
                raise RequestProblem(f"a {task} model does not clone voices ({field} given)", field)
    return task
