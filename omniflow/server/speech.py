"""`POST /v1/audio/speech`: text in, an audio file out (or, with `stream`, the audio as the
pipeline produces it), as OpenAI's and the peer's clients send it.

Fields: `input` (the pipeline's `text` input), `voice` (a named speaker: the pipeline's
`speaker` parameter or `voice` input; or a voice uploaded to the server, whose encoded
prompt it brings), the Qwen TTS fields (`task_type`, `language`, `x_vector_only_mode` and
`max_new_tokens` reach parameters, `instructions` and `ref_text` text inputs, of those
names), `ref_audio` (a voice clone's reference, fetched and checked here, encoded into
the voice prompt its model takes by the plan's voice encoder stage:
`omniflow.server.voices`), `speed` (the pipeline's `speed`
parameter if it has one, else the audio is time-stretched here, pitch kept), `stream`,
`response_format`, `stream_format` (`audio`: the bytes themselves; `sse`: OpenAI's
Server-Sent Events, `speech.audio.delta` with the bytes in base64, then `speech.audio.done`
with the usage). Every field is checked before admission; a bad one is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import base64

import torch

from omniflow.media import (
    AUDIO_MIME,
    ENCODED_AUDIO,
    SPEEDS,
    AudioEncoder,
    Tempo,
    audio_bytes,
    decode_audio,
)
from omniflow.runtime.port_values import concat
from omniflow.server import media_in, voices
from omniflow.server.chat import set_voice, sse
from omniflow.server.errors import APIError, bad_request
from omniflow.server.params import Params
from omniflow.server.protocol import SpeechRequest, merge_extra_body, validate
from omniflow.server.run import Run

SPEECH_FORMATS = ("wav", "pcm", "flac", "mp3", "opus", "aac")
STREAM_FORMATS = ("wav", "pcm", *ENCODED_AUDIO)
# Fields of the request that fill the pipeline's text inputs of the same names.
TEXT_FIELDS = ("instructions", "ref_text")
# Fields that reach parameters (the stage parameter they mean, where named otherwise).
PARAM_FIELDS = ("task_type", "language", "x_vector_only_mode", "max_new_tokens", "seed")
STREAM_KINDS = ("audio", "sse")  # `stream_format`: the bytes, or OpenAI's events


class SpeechJob:
    def __init__(self, served, inputs: dict, params: Params, fmt: str, stream: bool):
        self.served = served
        self.inputs = inputs
        self.params = params
        self.format = fmt
        self.stream = stream
        self.sse = False  # streamed as OpenAI's speech events (`stream_format: "sse"`)
        self.speed: float | None = None  # time-stretched here (the pipeline has no speed)
        self.audio_port = served.outputs_of("audio")[0]

    @property
    def outputs(self) -> set[str]:
        return {self.audio_port.name}

    @property
    def media_type(self) -> str:
        return "text/event-stream" if self.sse else AUDIO_MIME[self.format]


def check_format(fmt: str | None, stream: bool, allowed=SPEECH_FORMATS) -> str:
    fmt = fmt or "wav"
    if fmt not in allowed:
        raise bad_request(
            f"'response_format' {fmt!r} is not supported; use one of {', '.join(allowed)}",
            param="response_format",
        )
    if stream and fmt not in STREAM_FORMATS:
        raise bad_request(
            f"streamed speech is {', '.join(STREAM_FORMATS)}, not {fmt!r}",
            param="response_format",
        )
    return fmt


async def parse(server, served, body: dict) -> SpeechJob:
    request = validate(SpeechRequest, merge_extra_body(body))
    if not request.input.strip():
        raise bad_request("'input' must not be empty: it is what is spoken", param="input")
    extras = dict(request.model_extra or {})
    kind = extras.pop("stream_format", None) or "audio"
    if kind not in STREAM_KINDS:
        raise bad_request(
            f"'stream_format' {kind!r} is not supported; use one of {', '.join(STREAM_KINDS)}",
            param="stream_format",
        )
    stream = bool(request.stream) or kind == "sse"  # (events are a stream, whatever `stream`)
    fmt = check_format(request.response_format, stream)
    params = Params(served)
    params.input_fields[served.speech_input.name] = "input"
    job = SpeechJob(served, {served.speech_input.name: request.input}, params, fmt, stream)
    job.sse = kind == "sse"
    fields = request.model_dump(include=set(TEXT_FIELDS) | set(PARAM_FIELDS), exclude_none=True)
    await apply_voice(server, job, request.voice, request.ref_audio, fields.get("ref_text"))
    job.speed = take_speed(job, request.speed)
    take_fields(job, {**fields, **extras})
    return job


def take_fields(job: SpeechJob, fields: dict) -> None:
    """Fields naming one of the pipeline's text inputs fill it; the others reach its
    parameters (or are a 400 naming them)."""
    served, inputs = job.served, job.inputs
    rest = {}
    for name, value in fields.items():
        if served.input_named(name, "text") is not None and name not in inputs:
            if not isinstance(value, str):
                raise bad_request(f"'{name}' must be a string", param=name)
            inputs[name] = value
        elif name not in inputs:
            rest[name] = value
    job.params.take_all(rest)


def take_speed(job: SpeechJob, speed: float | None) -> float | None:
    """The speed the server stretches the audio to, if it does: None when the pipeline
    has a `speed` parameter (which takes it) or the speed is 1."""
    if speed is None:
        return None
    if job.params.target("speed") is not None:
        job.params.take("speed", speed)
        return None
    if not SPEEDS[0] <= speed <= SPEEDS[1]:
        raise bad_request(
            f"'speed' must be in {SPEEDS[0]:g} .. {SPEEDS[1]:g}, not {speed:g}", param="speed"
        )
    return None if speed == 1 else float(speed)


async def apply_voice(server, job: SpeechJob, voice, ref_audio, ref_text) -> None:
    """`voice` (a named speaker or an uploaded voice) and `ref_audio` (the clip, which the
    plan's voice encoder stage encodes) into the job's inputs and parameters."""
    served, inputs = job.served, job.inputs
    uploaded = server.voices.get(served.name, voice) if isinstance(voice, str) else None
    if uploaded is not None:
        if ref_audio is not None:
            raise bad_request(
                f"'ref_audio': voice {voice!r} is an uploaded voice, which brings its own "
                "reference; give one of them",
                param="ref_audio",
            )
        inputs.update(uploaded.inputs)
        if ref_text is not None and ref_text != uploaded.ref_text:
            raise bad_request(
                f"'ref_text': voice {voice!r} is an uploaded voice with its own transcript",
                param="ref_text",
            )
    elif voice is not None and voice != "":
        set_voice(served, job.params, inputs, voice, "voice")
    if ref_audio is None:
        return
    entry = await clone_entry(served)
    if entry is None and served.input_named("ref_audio", "text") is None:
        raise job.params.unknown(["ref_audio"])
    data = await server.fetch_media(ref_audio, "ref_audio")
    if entry is not None:  # read here (a 400 for what is not audio); encoded in the plan
        await decode_reference(server, data, "ref_audio")
        served.metrics.voice_encodes.labels(served.name).inc()
    name = entry.input if entry is not None else "ref_audio"
    inputs[name] = "data:;base64," + base64.b64encode(data).decode("ascii")


async def clone_entry(served) -> voices.VoiceEntry | None:
    """The pipeline's voice entry, if its models clone voices."""
    entry = served.voice_entry
    return entry if entry is not None and await entry.available() else None


async def decode_reference(server, data: bytes, where: str) -> tuple[torch.Tensor, int]:
    """An uploaded or inline reference clip's samples and rate, decoded off the event loop;
    a 400 at `where` if it is not audio, is empty or declares more than the server's
    references may be (`--max-audio-seconds`, and the voice store's clip limit)."""
    most = min(server.voices.max_seconds, server.config.max_audio_seconds)
    samples, rate = await media_in.decoded(decode_audio, data, where, most)
    if not len(samples) or not rate:
        raise bad_request(f"'{where}': the audio has no samples", param=where)
    return samples, rate


class AudioOut:
    """The reply's bytes from the pipeline's audio chunks: stretched to the job's speed,
    then encoded in its format, chunk by chunk."""

    def __init__(self, job: SpeechJob, rate: int):
        self.tempo = Tempo(job.speed, rate) if job.speed is not None else None
        self.encoder = AudioEncoder(job.format, rate)

    def feed(self, audio: torch.Tensor) -> bytes:
        if self.tempo is not None:
            audio = self.tempo.feed(audio)
        return self.encoder.feed(audio)

    def close(self) -> bytes:
        tail = self.encoder.feed(self.tempo.close()) if self.tempo is not None else b""
        return tail + self.encoder.close()


async def whole(job: SpeechJob, run: Run) -> bytes:
    parts = [value async for _, value in run.chunks()]
    # Minutes of audio take seconds to stretch and encode: off the event loop, which serves
    # every other client meanwhile.
    return await asyncio.to_thread(_encode_whole, job, parts, run.timeline.rate)


def _encode_whole(job: SpeechJob, parts: list[torch.Tensor], rate: int) -> bytes:
    samples = concat("audio", parts) if parts else torch.zeros(0, dtype=torch.int16)
    if job.speed is not None:
        tempo = Tempo(job.speed, rate)
        samples = torch.cat([tempo.feed(samples), tempo.close()])
    return audio_bytes(samples, rate, job.format)


async def streamed(job: SpeechJob, run: Run):
    """Audio bytes as produced, or with `stream_format: "sse"` OpenAI's events carrying them;
    a stage failure ends the stream early (the status is sent)."""
    audio = _audio(job, run)
    async for data in _events(audio, run) if job.sse else audio:
        yield data


async def _audio(job: SpeechJob, run: Run):
    out = AudioOut(job, run.timeline.rate)
    async for _, value in run.chunks():
        if data := out.feed(value):
            yield data
    if data := out.close():
        yield data


async def _events(audio, run: Run):
    """OpenAI's speech events: `speech.audio.delta` for each piece of `audio`, then
    `speech.audio.done` with the usage (the talker's prompt and codec tokens, where its end
    said them); a failure once the stream has begun is its last event."""

    try:
        async for data in audio:
            yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
    except APIError as err:
        run.error = err
        yield sse(err.body())
        return
    said = run.audio_ending
    prompt, codes = (said.prompt_tokens, said.tokens) if said is not None else (0, 0)
    usage = {"input_tokens": prompt, "output_tokens": codes, "total_tokens": prompt + codes}
    yield sse({"type": "speech.audio.done", "usage": usage})
