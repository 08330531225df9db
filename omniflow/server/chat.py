"""`POST /v1/chat/completions`: messages in, text and audio out, whole or as SSE.

The chat messages become the pipeline's `chat` input; an image part (`image_url`) becomes
its image input and an audio part (`input_audio`, `audio_url`) its audio input, each
replaced in the chat by a placeholder part (`{"type": "image"}`), so a pipeline without
such an input answers 400 instead of failing in a stage. `modalities` picks the outputs
(default: every text and audio output the pipeline has); `audio.voice` sets the speaker;
the sampling fields reach the pipeline's parameters (params.py); `stop` is the pipeline's
`stop` parameter if it declares one, else the server cuts the text at the first stop
string and ends the request there.

Streaming sends each chunk as the engine yields it: text as `delta.content`, audio as
`delta.audio.data` (base64 16-bit PCM, or a WAV whose header comes with the first
chunk), so the first audio delta leaves when the pipeline's first audio chunk arrives.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid

import torch

from omniflow.media import (
    MediaError,
    audio_bytes,
    decode_audio,
    decode_image,
    probe_video,
    resample,
    streaming_wav_header,
)
from omniflow.runtime.port_values import concat
from omniflow.server import media_in
from omniflow.server.errors import APIError, bad_request
from omniflow.server.params import Params, is_no_op, parse_form_value
from omniflow.server.protocol import (
    AudioURLPart,
    ChatCompletionRequest,
    ImagePart,
    InputAudioPart,
    TextPart,
    VideoURLPart,
    merge_extra_body,
    validate,
)
from omniflow.server.run import Run

CHAT_AUDIO_FORMATS = {"wav": "wav", "pcm16": "pcm", "pcm": "pcm", "flac": "flac"}
STREAM_AUDIO_FORMATS = ("wav", "pcm16", "pcm")
MAX_STOPS = 4
AUDIO_LIFETIME_S = 3600  # `expires_at`: nothing is kept, but OpenAI's schema has the field


class ChatJob:
    """A chat request resolved against its pipeline: inputs, parameters, what to answer."""

    def __init__(self, served, inputs: dict, params: Params, request: ChatCompletionRequest):
        self.served = served
        self.inputs = inputs
        self.params = params
        self.request = request
        self.text_port = next(iter(served.outputs_of("text")), None)
        self.audio_port = next(iter(served.outputs_of("audio")), None)
        self.want_text = self.want_audio = False
        self.audio_format = "wav"
        self.stops: list[str] = []

    @property
    def outputs(self) -> set[str]:
        wanted = set()
        if self.want_text:
            wanted.add(self.text_port.name)
        if self.want_audio:
            wanted.add(self.audio_port.name)
        return wanted


async def parse(server, served, body: dict) -> ChatJob:
    body = merge_extra_body(body)
    request = validate(ChatCompletionRequest, body)
    params = Params(served)
    inputs: dict = {}
    await _messages(server, served, request, inputs, params.input_fields)
    job = ChatJob(served, inputs, params, request)
    _modalities(job)
    _audio_options(job)
    stream = bool(request.stream)
    if stream and job.want_audio and job.audio_format not in ("wav", "pcm"):
        raise bad_request(
            f"streamed audio is {' or '.join(STREAM_AUDIO_FORMATS)}, not '{request.audio.format}'",
            param="audio.format",
        )
    if request.n is not None and not is_no_op("n", request.n):
        raise bad_request("'n' must be 1: a chat request has one answer here", param="n")
    for name in ("max_tokens", "max_completion_tokens", "temperature", "top_p", "seed"):
        if not params.take(name, getattr(request, name)):
            raise params.unknown([name])
    for name, value in (request.mm_processor_kwargs or {}).items():
        if not params.take(name, value, f"mm_processor_kwargs.{name}"):
            raise params.unknown([f"mm_processor_kwargs.{name}"])
    _stops(job)
    if request.sampling_params_list is not None:
        params.sampling_params_list(request.sampling_params_list)
    extras = dict(request.model_extra or {})
    for name in list(extras):  # a field naming one of the pipeline's text inputs fills it
        port = served.input_named(name, "text")
        if port is not None and port.name not in inputs and port != served.chat_input:
            inputs[port.name] = _text_field(name, extras.pop(name))
    params.take_all(extras)
    return job


def _text_field(name: str, value) -> str:
    if not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string", param=name)
    return value


async def _messages(
    server, served, request: ChatCompletionRequest, inputs: dict, input_fields: dict
) -> None:
    """The chat's messages into the pipeline's chat input, and their media parts into its
    media inputs; `input_fields` names the part a media input's one item came from (a
    refusal of that input names it), or `messages` where it holds several."""
    chat, images, audios, videos = [], [], [], []
    in_video = _audio_in_video(request)
    for i, message in enumerate(request.messages):
        where = f"messages[{i}]"
        if message.tool_calls or message.role == "tool":
            raise bad_request(
                f"'{where}': tool calls are not supported by this server", param=where
            )
        if message.audio is not None:
            raise bad_request(
                f"'{where}.audio': this server keeps no audio between requests; send the "
                "assistant's transcript as 'content'",
                param=f"{where}.audio",
            )
        content = message.content
        if (content is None and message.refusal is None) or content == []:
            raise bad_request(
                f"'{where}.content': required: a string or a list of parts (at least one)",
                param=f"{where}.content",
            )
        if content is None:  # an assistant's earlier turn that refused: what it said
            content = message.refusal
        if isinstance(content, list):
            content = await _parts(server, content, where, images, audios, videos, in_video)
        entry = {"role": "system" if message.role == "developer" else message.role}
        entry["content"] = content
        if message.name is not None:
            entry["name"] = message.name
        chat.append(entry)
    inputs[served.chat_input.name] = chat
    for items, port_type, part in (
        (images, "image", "image_url"),
        (audios, "audio", "input_audio"),
        (videos, "video", "video_url"),
    ):
        await _media_input(server, served, inputs, input_fields, items, port_type, part)


def _audio_in_video(request: ChatCompletionRequest) -> bool:
    """Whether a video's audio track goes in beside it: `use_audio_in_video`, in
    `mm_processor_kwargs` (vLLM's place) or at the top level, read as the pipeline's
    parameter of that name reads it (a boolean, or "false", "0", "no" ... as text), so that
    the two agree."""
    fields = (
        ("mm_processor_kwargs.use_audio_in_video", request.mm_processor_kwargs or {}),
        ("use_audio_in_video", request.model_extra or {}),
    )
    for where, values in fields:
        value = values.get("use_audio_in_video")
        if isinstance(value, str):
            value = parse_form_value(where, value, bool)
        if value is not None and not isinstance(value, bool):
            raise bad_request(f"'{where}' must be a boolean, not {value!r}", param=where)
        if value is not None:
            return value
    return False


async def _parts(server, parts, where: str, images, audios, videos, in_video: bool):
    out, limits = [], server.config
    for j, part in enumerate(parts):
        at = f"{where}.content[{j}]"
        if isinstance(part, TextPart):
            out.append({"type": "text", "text": part.text})
        elif isinstance(part, ImagePart):
            url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
            field = f"{at}.image_url"
            data = await server.fetch_media(url, field)
            image = await media_in.decoded(decode_image, data, field, limits.max_image_pixels)
            images.append((field, image))
            out.append({"type": "image"})
        elif isinstance(part, (InputAudioPart, AudioURLPart)):
            if isinstance(part, InputAudioPart):
                field = f"{at}.input_audio"
                # Base64, as OpenAI sends it; a data: URI too, as some clients do.
                text, where = part.input_audio.data, f"{field}.data"
                read = media_in.data_uri if text.startswith("data:") else media_in.base64_bytes
                data = read(text, where, limits.max_media_bytes)
            else:
                url = part.audio_url if isinstance(part.audio_url, str) else part.audio_url.url
                field = f"{at}.audio_url"
                data = await server.fetch_media(url, field)
            clip = await media_in.decoded(speech_clip, data, field, limits.max_audio_seconds)
            audios.append((field, clip))
            out.append({"type": "audio"})
        elif isinstance(part, VideoURLPart):
            url = part.video_url if isinstance(part.video_url, str) else part.video_url.url
            field = f"{at}.video_url"
            data = await server.fetch_media(url, field)
            # A video that does not decode is the request's fault: a 400 now, not in a stage
            # (decoded in a worker thread, its frames not kept: the stage samples them).
            video = await media_in.decoded(probe_video, data, field, limits.max_video_pixels)
            if video.frames < MIN_VIDEO_FRAMES:
                raise bad_request(
                    f"'{field}': the video has {video.frames} frame; a video has at least "
                    f"{MIN_VIDEO_FRAMES} (a still picture goes in an image_url part)",
                    param=field,
                )
            if in_video:  # its audio track goes in as the next audio item
                note = " (use_audio_in_video needs its audio track)"
                track = await media_in.decoded(
                    speech_clip, data, field, limits.max_audio_seconds, note=note
                )
                audios.append((field, track))
            videos.append((field, torch.frombuffer(bytearray(data), dtype=torch.uint8)))
            out.append({"type": "video"})
        else:
            raise bad_request(f"'{at}': unsupported part", param=at)
    if all(p["type"] == "text" for p in out):
        return "\n".join(p["text"] for p in out)
    return out


# The fewest frames a chat's video may have: video towers take frames in pairs (Qwen2-VL's
# processor and those after it: temporal patches of 2), and one frame is a picture.
MIN_VIDEO_FRAMES = 2

# What a chat's audio becomes before it reaches a pipeline's audio input: mono float32 at
# the rate speech encoders take (16 kHz: Whisper's front end, the omni models' processors).
SPEECH_RATE = 16000
# The shortest clip: one analysis window of that front end (Whisper's n_fft, 400 samples),
# which its STFT's reflect padding needs (a shorter one failed the hearing stage).
MIN_CLIP_SAMPLES = 400


def speech_clip(data: bytes, max_seconds: float) -> tuple[torch.Tensor, int]:
    """An audio file as a chat's audio item: decoded (at most `max_seconds`) and resampled."""
    samples, rate = decode_audio(data, max_seconds)
    clip = resample(samples, rate, SPEECH_RATE) if len(samples) else samples
    if len(clip) < MIN_CLIP_SAMPLES:
        raise MediaError(
            f"the audio is {len(samples) / rate * 1000:.1f} ms long; a clip is at least "
            f"{MIN_CLIP_SAMPLES / SPEECH_RATE * 1000:g} ms (one window of the speech encoders' "
            "front end)"
        )
    return clip, SPEECH_RATE


async def _media_input(
    server, served, inputs: dict, input_fields: dict, items: list, port_type: str, part: str
) -> None:
    """The chat's media `items` ((the part's field, its value)) of one type into the
    pipeline's inputs of that type (images scaled down, where they must be, to fit the
    plan's buffer for their input: `media_in.fit_images`)."""
    if not items:
        return
    ports = served.inputs_of(port_type)
    if not ports:
        able = [
            s.name
            for s in server.served.values()
            if s.inputs_of(port_type) and "chat" in s.capabilities
        ]
        hint = f"; pipelines here that do: {', '.join(able)}" if able else ""
        raise bad_request(
            f"pipeline '{served.name}' takes no {port_type} input (its inputs: "
            f"{', '.join(f'{p.name} ({p.type})' for p in served.plan.inputs)}), so a chat "
            f"message cannot carry {part} parts{hint}",
            param="messages",
        )
    fields = [field for field, _ in items]
    values = [v[0] if port_type == "audio" else v for _, v in items]
    if len(ports) == 1 and ports[0].optional:  # several items of one request, in chat order
        if port_type == "image":
            values = await _fitted(served, ports[0].name, values)
        inputs[ports[0].name] = values if len(values) > 1 else values[0]
        input_fields[ports[0].name] = fields[0] if len(fields) == 1 else "messages"
        return
    if len(values) > len(ports):
        raise bad_request(
            f"pipeline '{served.name}' takes {len(ports)} {port_type}(s) per request; the "
            f"messages carry {len(values)}",
            param="messages",
        )
    for port, value, field in zip(ports, values, fields, strict=False):
        if port_type == "image":
            (value,) = await _fitted(served, port.name, [value])
        inputs[port.name] = value
        input_fields[port.name] = field


async def _fitted(served, port: str, images: list[torch.Tensor]) -> list[torch.Tensor]:
    """`images` as the pipeline input `port` takes them together: scaled down to its
    buffer's bytes where they are larger (in a worker thread: a photo's resize is tens of
    milliseconds)."""
    room = [c.slot_bytes for c in served.plan.channels if c.src == port]
    if not room:
        return images
    return await asyncio.to_thread(media_in.fit_images, images, min(room))


def _modalities(job: ChatJob) -> None:
    served, modalities = job.served, job.request.modalities
    if modalities is None:
        job.want_text = job.text_port is not None
        job.want_audio = job.audio_port is not None
        return
    if not modalities:
        raise bad_request("'modalities' must name at least one of text, audio", param="modalities")
    for modality in modalities:
        port = {"text": job.text_port, "audio": job.audio_port}.get(modality)
        if port is None:
            raise bad_request(
                f"'modalities' asks for {modality}; {served.describe()}", param="modalities"
            )
    job.want_text = "text" in modalities
    job.want_audio = "audio" in modalities


def _audio_options(job: ChatJob) -> None:
    audio = job.request.audio
    if audio is None:
        return
    if audio.format is not None:
        if audio.format not in CHAT_AUDIO_FORMATS:
            raise bad_request(
                f"'audio.format' {audio.format!r} is not supported; use one of "
                f"{', '.join(CHAT_AUDIO_FORMATS)}",
                param="audio.format",
            )
        job.audio_format = CHAT_AUDIO_FORMATS[audio.format]
    if audio.voice is not None:
        set_voice(job.served, job.params, job.inputs, audio.voice, "audio.voice")


def set_voice(served, params: Params, inputs: dict, voice: str, where: str) -> None:
    """A voice goes to the pipeline's `speaker` or `voice` parameter, else its `voice` input."""
    for name in ("speaker", "voice"):
        if name in served.plan.limits:
            params.set(name, voice, where)
            return
    if served.input_named("voice", "text") is not None:
        inputs["voice"] = voice
        return
    raise bad_request(
        f"'{where}': pipeline '{served.name}' has no voice to choose (no 'speaker' or 'voice' "
        "parameter or input)",
        param=where,
    )


def _stops(job: ChatJob) -> None:
    stop = job.request.stop
    if stop is None:
        return
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOPS or not all(stops):
        raise bad_request(f"'stop' takes up to {MAX_STOPS} non-empty strings", param="stop")
    if "stop" in job.served.plan.limits:
        job.params.set("stop", stops, "stop")
    else:
        job.stops = stops


# --- answering ------------------------------------------------------------------------------
def make_run(job: ChatJob, admitted, request_id: str, began: float) -> Run:
    return Run(job.served, admitted, request_id, job.outputs, began, stops=job.stops)


def _encoded_audio(parts: list[torch.Tensor], rate: int, fmt: str) -> str:
    """The reply's audio chunks as one file in `fmt`, base64-encoded."""
    samples = concat("audio", parts) if parts else torch.zeros(0, dtype=torch.int16)
    return base64.b64encode(audio_bytes(samples, rate, fmt)).decode()


async def answer(job: ChatJob, run: Run) -> dict:
    """The whole reply, as `chat.completion`."""
    texts, audio = [], []
    async for output, value in run.chunks():
        (texts if job.want_text and output == job.text_port.name else audio).append(value)
    text = "".join(texts) if job.want_text else None
    message: dict = {"role": "assistant", "content": text}
    if job.want_audio:
        # Off the event loop: a long reply's encoding takes seconds the other clients need.
        data = await asyncio.to_thread(_encoded_audio, audio, run.timeline.rate, job.audio_format)
        message["audio"] = {
            "id": f"audio_{run.request_id}",
            "data": data,
            "expires_at": int(time.time()) + AUDIO_LIFETIME_S,
        }
        if text is not None:  # what was spoken, when the text was asked for too
            message["audio"]["transcript"] = text
    return {
        "id": run.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": job.served.name,
        "choices": [
            {"index": 0, "message": message, "finish_reason": run.finish_reason, "logprobs": None}
        ],
        "usage": run.usage,
        "seed": run.seed,
    }


def sse(body: dict) -> bytes:
    """One Server-Sent Event: `body` as JSON on a `data:` line."""
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def events(job: ChatJob, run: Run):
    """The reply as Server-Sent Events (`data: {...}` lines, then `data: [DONE]`)."""
    created = int(time.time())
    audio_id = f"audio_{run.request_id}"
    sent_header = False

    def chunk(delta: dict, finish=None, **extra) -> bytes:
        body = {
            "id": run.request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": job.served.name,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
            **extra,
        }
        return sse(body)

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for output, value in run.chunks():
            if job.text_port is not None and output == job.text_port.name:
                yield chunk({"content": value})
                continue
            data = audio_bytes(value, run.timeline.rate, "pcm")
            if job.audio_format == "wav" and not sent_header:
                data = streaming_wav_header(run.timeline.rate) + data
                sent_header = True
            yield chunk({"audio": {"id": audio_id, "data": base64.b64encode(data).decode()}})
    except APIError as err:  # the stream has begun: the error is its last event
        run.error = err
        yield sse(err.body())
        yield b"data: [DONE]\n\n"
        return
    final: dict = {}
    if job.want_audio:
        final["audio"] = {"id": audio_id, "expires_at": int(time.time()) + AUDIO_LIFETIME_S}
        if not sent_header and job.audio_format == "wav":  # no audio came: still a valid WAV
            final["audio"]["data"] = base64.b64encode(
                streaming_wav_header(run.timeline.rate)
            ).decode()
    yield chunk(final, finish=run.finish_reason, seed=run.seed)
    include_usage = job.request.stream_options and job.request.stream_options.include_usage
    if include_usage:
        body = {
            "id": run.request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": job.served.name,
            "choices": [],
            "usage": run.usage,
        }
        yield sse(body)
    yield b"data: [DONE]\n\n"


def new_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"
