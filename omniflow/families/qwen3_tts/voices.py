"""Voices of a Qwen3-TTS checkpoint: reference audio, a clone's voice prompt, and the
family's admission checks.

A voice clone (a Base checkpoint) starts from reference audio: its x-vector (the speaker
encoder's embedding of its mel spectrogram) and, unless `x_vector_only_mode`, its codes
(the speech tokenizer's Mimi encoder, 16 codebooks a 12.5 Hz frame) with its transcript.
`VoiceEncoder`, the model of the graph's `voice_encoder` stage, computes both as a voice
prompt: a text (`PROMPT_PREFIX` + base64 of a safetensors file holding `x_vector` `[D]`
float32 and `ref_codes` `[frames, 16]` int16) that it sends the talker stage on its
`ref_audio` port; the talker decodes it and encodes nothing. The server keeps uploaded
voices as their prompts (a request for the plan's `voice_prompt` output alone runs this
stage alone) and sends them back as `ref_audio`, which the encoder passes on as it is.

`admission(stage, path)` is `Family.admission`: a request checked against the checkpoint
at admission (`config.check_task_inputs`, the talker's own rules), so that a task it does
not do, a language it does not speak or a missing reference is a 400, not a failed stage.
"""

from __future__ import annotations

import base64
import binascii
import functools
import os
from collections.abc import Callable

import torch

from omniflow.backends.vision import RequestEncoder
from omniflow.families.qwen3_tts.config import (
    Qwen3TTSError,
    RequestProblem,
    TTSConfig,
    check_task_inputs,
)
from omniflow.plan import StagePlan

PROMPT_PREFIX = "qwen3-tts-voice:"
SAMPLE_RATE = 24000
# The longest reference audio decoded here (the server takes 60 s; a file given by path or
# base64 is bounded too, its length checked before it is decoded).
MAX_REFERENCE_SECONDS = 600.0


# --- voice prompts ------------------------------------------------------------------------------
def is_prompt(value) -> bool:
    return isinstance(value, str) and value.startswith(PROMPT_PREFIX)


def encode_prompt(x_vector: torch.Tensor, ref_codes: torch.Tensor | None) -> str:
    """A voice prompt's text: the x-vector `[D]` and the reference's codes `[frames, G]`."""
    from safetensors.torch import save

    tensors = {"x_vector": x_vector.detach().float().cpu().reshape(-1).contiguous()}
    if ref_codes is not None:
        tensors["ref_codes"] = ref_codes.detach().cpu().to(torch.int16).contiguous()
    return PROMPT_PREFIX + base64.b64encode(save(tensors)).decode("ascii")


def decode_prompt(text: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The x-vector `[D]` float32 and the reference codes `[frames, G]` int64 (None when
    the prompt has none) of a voice prompt; Qwen3TTSError if it is not one."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensors = load(base64.b64decode(text[len(PROMPT_PREFIX) :], validate=True))
        x_vector = tensors["x_vector"]
    except (binascii.Error, ValueError, KeyError, SafetensorError) as err:
        raise Qwen3TTSError(f"ref_audio is not a readable voice prompt: {err}") from None
    codes = tensors.get("ref_codes")
    if x_vector.dim() != 1 or (codes is not None and codes.dim() != 2):
        raise Qwen3TTSError("ref_audio is not a readable voice prompt: wrong shapes")
    return x_vector, None if codes is None else codes.long()


def reference_audio(value) -> torch.Tensor:
    """A voice clone's reference audio as 24 kHz mono float32 samples: a tensor is taken as
    24 kHz samples; a string is a file path, a `data:` URI or base64 of an audio file."""
    from omniflow.media import MediaError, decode_audio

    if isinstance(value, torch.Tensor):
        audio = value.float().reshape(-1)
        if not len(audio):
            raise Qwen3TTSError("ref_audio is empty")
        return audio
    text = value.strip()
    try:
        if os.path.isfile(text):
            with open(text, "rb") as f:
                data = f.read()
        else:
            payload = text.split(",", 1)[1] if text.startswith("data:") else text
            data = base64.b64decode(payload, validate=True)
        samples, rate = decode_audio(data, MAX_REFERENCE_SECONDS)
    except (OSError, binascii.Error, ValueError, MediaError) as err:
        raise Qwen3TTSError(
            f"ref_audio is neither a readable audio file nor base64 audio: {err}"
        ) from err
    return mono_24k(samples, rate)


def check_length(audio: torch.Tensor, config: TTSConfig) -> torch.Tensor:
    """24 kHz reference audio, if the speaker encoder can take it (Qwen3TTSError if it is
    shorter than that: `modeling.min_speaker_samples`)."""
    from omniflow.families.qwen3_tts.modeling import min_speaker_samples

    least = min_speaker_samples(config)
    if len(audio) < least:
        raise Qwen3TTSError(
            f"ref_audio is {1000 * len(audio) / SAMPLE_RATE:.0f} ms long; the speaker encoder "
            f"needs at least {1000 * least / SAMPLE_RATE:.0f} ms"
        )
    return audio


def mono_24k(samples: torch.Tensor, rate: int) -> torch.Tensor:
    """Samples `[n]` or `[n, channels]` at `rate` as 24 kHz mono float32."""
    from omniflow.families.qwen3_tts.modeling import resample

    audio = samples.float()
    if audio.dim() == 2:
        audio = audio.mean(dim=1)
    audio = audio.reshape(-1)
    if not len(audio):
        raise Qwen3TTSError("ref_audio has no samples")
    return resample(audio, int(rate), SAMPLE_RATE)


# --- the voice encoder ------------------------------------------------------------------------
class VoiceEncoder(RequestEncoder):
    """The `voice_encoder` stage's model: a Base checkpoint's speaker encoder and speech
    tokenizer encoder. Its `ref_audio` (audio: a file path, base64 or a `data:` URI of an
    audio file, or 24 kHz samples) becomes the voice prompt on `voice`; a voice prompt
    passes on as it is (encoded before: an uploaded voice), and no reference sends nothing.
    A checkpoint that clones no voices (`speaker` None) loads nothing and refuses audio."""

    def __init__(self, config: TTSConfig, speaker, tokenizer):
        self.config = config
        self.speaker = speaker
        self.tokenizer = tokenizer

    def to(self, device: str) -> VoiceEncoder:
        if self.speaker is not None:
            self.speaker.to(device)
            self.tokenizer.to(device)
        return self

    def encode(self, values: dict) -> dict:
        ref_audio = values.get("ref_audio")
        if ref_audio is None or (isinstance(ref_audio, str) and not ref_audio):
            return {}
        if is_prompt(ref_audio):
            return {"voice": ref_audio}
        if self.speaker is None:
            raise Qwen3TTSError(
                f"this {self.config.task} checkpoint clones no voices: ref_audio takes a Base one"
            )
        from omniflow.families.qwen3_tts.modeling import speaker_embedding

        audio = check_length(reference_audio(ref_audio), self.config)
        with torch.inference_mode():
            x_vector = speaker_embedding(self.speaker, audio)
            codes = self.tokenizer.encode(audio)
        return {"voice": encode_prompt(x_vector, codes)}


def load(path: str, component: str | None, dtype) -> VoiceEncoder:
    """The `encoder` stage's model (`component="voice_encoder"`), on the CPU until the
    backend moves it."""
    from omniflow.families.qwen3_tts.modeling import load_speaker_encoder
    from omniflow.families.qwen3_tts.speech_tokenizer import load_encoder

    if component != "voice_encoder":
        raise Qwen3TTSError(
            f"Qwen3-TTS has no '{component}' encoder; use component=\"voice_encoder\""
        )
    config = _config(path)
    if config is None:
        raise Qwen3TTSError(f"{path} is not a Qwen3-TTS checkpoint")
    if config.task != "Base":
        return VoiceEncoder(config, None, None)
    speaker = load_speaker_encoder(path, config, dtype, "cpu")
    return VoiceEncoder(config, speaker, load_encoder(path, "cpu"))


# --- admission -------------------------------------------------------------------------------
def admission(stage: StagePlan, path: str) -> Callable[[dict, dict], None] | None:
    """`Family.admission`: a talker stage's requests checked against its checkpoint (the
    task it does, its languages, speakers, what a voice clone needs) and a voice encoder
    stage's reference (that `ref_audio` reads, and that the checkpoint clones voices)
    before any stage sees them."""
    from omniflow.runtime.requests import StageRequestError

    config = _config(path)
    if config is None or stage.kind not in ("ar", "encoder"):
        return None
    if stage.kind == "encoder":
        return functools.partial(_check_reference, config)

    def check(params: dict, inputs: dict) -> None:
        voice_field = "voice" if "voice" in inputs else "speaker"
        voice = inputs["voice"] if "voice" in inputs else params.get("speaker")
        ref_audio = inputs.get("ref_audio")
        if isinstance(voice, torch.Tensor):  # audio on the voice port: a clone's reference
            voice, ref_audio = None, voice if ref_audio in (None, "") else ref_audio
        given = isinstance(ref_audio, torch.Tensor) or bool(ref_audio)
        try:
            check_task_inputs(
                config,
                task_type=params.get("task_type") or None,
                language=params.get("language") or None,
                voice=voice or None,
                instructions=_text(inputs.get("instructions")),
                ref_audio=given,
                ref_text=_text(inputs.get("ref_text")),
                x_vector_only=bool(params.get("x_vector_only_mode")),
                voice_field=voice_field,
            )
        except RequestProblem as err:
            raise StageRequestError(str(err), err.field) from None
        except Qwen3TTSError as err:
            raise StageRequestError(str(err), "ref_audio") from None

    return check


def _check_reference(config: TTSConfig, params: dict, inputs: dict) -> None:
    """The voice encoder stage's check: a Base checkpoint's `ref_audio` is a voice prompt,
    or decodable audio long enough to encode."""
    from omniflow.runtime.requests import StageRequestError

    ref_audio = inputs.get("ref_audio")
    if ref_audio is None or (isinstance(ref_audio, str) and not ref_audio):
        return
    if config.task != "Base":
        return  # the talker's check names what the checkpoint does instead
    try:
        if is_prompt(ref_audio):
            decode_prompt(ref_audio)
        else:
            check_length(reference_audio(ref_audio), config)
    except Qwen3TTSError as err:
        raise StageRequestError(str(err), "ref_audio") from None


def _text(value) -> str:
    return value if isinstance(value, str) else ""


def _config(path: str) -> TTSConfig | None:
    from omniflow.families.qwen3_tts import checkpoint_config

    raw = checkpoint_config(path)
    return None if raw is None else TTSConfig.of(raw)
