"""`POST /v1/audio/speech`: text in, an audio file out (or, with `stream`, the audio as the
pipeline produces it: a WAV header then its samples, or raw 16-bit PCM)."""

from __future__ import annotations

import torch

from omniflow.media import AUDIO_MIME, audio_bytes, streaming_wav_header
from omniflow.runtime.port_values import concat
from omniflow.server.chat import set_voice
from omniflow.server.errors import bad_request
from omniflow.server.params import Params
from omniflow.server.protocol import SpeechRequest, merge_extra_body, validate
from omniflow.server.run import Run

SPEECH_FORMATS = ("wav", "pcm", "flac")
STREAM_FORMATS = ("wav", "pcm")


class SpeechJob:
    def __init__(self, served, inputs: dict, params: Params, fmt: str, stream: bool):
        self.served = served
        self.inputs = inputs
        self.params = params
        self.format = fmt
        self.stream = stream
        self.audio_port = served.outputs_of("audio")[0]

    @property
    def media_type(self) -> str:
        return AUDIO_MIME[self.format]


def parse(served, body: dict) -> SpeechJob:
    request = validate(SpeechRequest, merge_extra_body(body))
    fmt = request.response_format or "wav"
    if fmt not in SPEECH_FORMATS:
        raise bad_request(
            f"'response_format' {fmt!r} is not supported; use one of {', '.join(SPEECH_FORMATS)}",
            param="response_format",
        )
    stream = bool(request.stream)
    if stream and fmt not in STREAM_FORMATS:
        raise bad_request(
            f"streamed speech is {' or '.join(STREAM_FORMATS)}, not {fmt!r}",
            param="response_format",
        )
    params = Params(served)
    inputs = {served.speech_input.name: request.input}
    if request.voice is not None:
        set_voice(served, params, inputs, request.voice, "voice")
    if not params.take("speed", request.speed):
        raise bad_request(
            f"'speed' must be 1.0: pipeline '{served.name}' has no speed parameter", param="speed"
        )
    extras = dict(request.model_extra or {})
    if extras.get("stream_format") in ("audio", None):
        extras.pop("stream_format", None)
    for name in list(extras):  # a field naming one of the pipeline's text inputs fills it
        if served.input_named(name, "text") is not None and name not in inputs:
            value = extras.pop(name)
            if not isinstance(value, str):
                raise bad_request(f"'{name}' must be a string", param=name)
            inputs[name] = value
    params.take_all(extras)
    return SpeechJob(served, inputs, params, fmt, stream)


async def whole(job: SpeechJob, run: Run) -> bytes:
    parts = [value async for _, value in run.chunks()]
    samples = concat("audio", parts) if parts else torch.zeros(0, dtype=torch.int16)
    return audio_bytes(samples, run.timeline.rate, job.format)


async def streamed(job: SpeechJob, run: Run):
    """Audio bytes as produced; a stage failure ends the stream early (the status is sent)."""
    if job.format == "wav":
        yield streaming_wav_header(run.timeline.rate)
    async for _, value in run.chunks():
        yield audio_bytes(value, run.timeline.rate, "pcm")
