"""The request bodies the server takes, as pydantic models: they check types (strictly: no
`"7"` for a number in JSON) and give the OpenAPI schema (`/openapi.json`) that clients and
the schema fuzzer read.

Top-level objects allow fields beyond these (`extra="allow"`): those are checked against
the served pipeline's parameters (params.py), reaching it or answered with a 400 naming
them. Nested objects (messages, parts, `audio`, `stream_options`) forbid unknown fields.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from omniflow.server.errors import APIError, bad_request


class _Top(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class _Nested(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class URL(_Nested):
    url: str = Field(description="a data: URI, a local file path (or file:// URL), or http(s)")
    detail: str | None = None


class TextPart(_Nested):
    type: Literal["text"]
    text: str


class ImagePart(_Nested):
    type: Literal["image_url"]
    image_url: URL | str


class InputAudio(_Nested):
    data: str = Field(description="base64 audio file bytes")
    format: str | None = Field(None, description="wav, flac, ... (read from the bytes)")


class InputAudioPart(_Nested):
    type: Literal["input_audio"]
    input_audio: InputAudio


class AudioURLPart(_Nested):
    type: Literal["audio_url"]
    audio_url: URL | str


class VideoURLPart(_Nested):
    type: Literal["video_url"]
    video_url: URL | str


Part = Annotated[
    TextPart | ImagePart | InputAudioPart | AudioURLPart | VideoURLPart,
    Field(discriminator="type"),
]


class AudioRef(_Nested):
    id: str


class Message(_Nested):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    name: str | None = None
    audio: AudioRef | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict] | None = None
    refusal: str | None = None


class AudioOptions(_Nested):
    voice: str | None = Field(None, description="the pipeline's speaker (or voice)")
    format: str | None = Field(None, description="wav (default), pcm16, flac")


class StreamOptions(_Nested):
    include_usage: bool | None = None


class ChatCompletionRequest(_Top):
    """OpenAI chat completions; pipeline parameters may also be given at the top level or in
    `extra_body`."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    modalities: list[Literal["text", "audio", "image"]] | None = None
    audio: AudioOptions | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    extra_body: dict | None = None
    sampling_params_list: list[dict] | dict | None = None
    # vLLM's: the model processor's options, each the pipeline parameter of its name
    # (`use_audio_in_video`).
    mm_processor_kwargs: dict | None = None

    @field_validator("stream_options")
    @classmethod
    def _streamed_only(cls, value: StreamOptions | None, info: ValidationInfo):
        # Asked for a usage chunk that a reply in one piece never sends (vLLM refuses it too).
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options are for streamed replies: set stream to true")
        return value


class SpeechRequest(_Top):
    """OpenAI text to speech, as the peer's clients send it; the Qwen TTS fields reach the
    pipeline's parameters or inputs of those names (`max_new_tokens` its `ar` stage's
    `max_tokens`), `ref_audio` encoded once into a voice prompt."""

    model: str | None = None
    input: str
    voice: str | None = Field(None, description="a named speaker, or an uploaded voice")
    response_format: str | None = Field(
        None, description="wav (default), pcm, flac, mp3, opus, aac"
    )
    speed: float | None = Field(None, description="0.25 .. 4 (1: as the model speaks)")
    stream: bool | None = None
    task_type: str | None = Field(None, description="CustomVoice, VoiceDesign or Base")
    language: str | None = Field(None, description="Auto, Chinese, English, Japanese, ...")
    instructions: str | None = None
    ref_audio: str | None = Field(
        None, description="a voice clone's reference: a data: URI, base64, a file or a URL"
    )
    ref_text: str | None = None
    x_vector_only_mode: bool | None = None
    max_new_tokens: int | None = None
    seed: int | None = None
    extra_body: dict | None = None


class ImageGenerationRequest(_Top):
    """OpenAI (DALL-E style) image generation; every diffusion sampling field at the top."""

    model: str | None = None
    prompt: str
    negative_prompt: str | None = None
    size: str | None = Field(None, description='"WIDTHxHEIGHT", e.g. "512x512"')
    n: int | None = Field(None, ge=1, le=10)
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    seed: int | None = None
    response_format: str | None = Field(None, description="b64_json")
    output_format: str | None = Field(None, description="png (default), jpeg, webp")
    extra_body: dict | None = None


def parse_json(body: bytes) -> dict:
    """A request body as a JSON object, or a 400 saying why not (NaN and Infinity, which
    Python's json would take, are not JSON)."""

    def no_constants(name):
        raise ValueError(f"{name} is not a JSON number")

    try:
        value = json.loads(body, parse_constant=no_constants)
    except RecursionError:  # nested past what Python's parser recurses through
        raise bad_request("the body is JSON nested too deeply", code="invalid_json") from None
    except ValueError as err:
        raise bad_request(f"the body is not valid JSON: {err}", code="invalid_json") from None
    if not isinstance(value, dict):
        raise bad_request(
            f"the body must be a JSON object, not {json_kind(value)}", code="invalid_json"
        )
    check_unicode(body, value)
    return value


# A JSON escape of a UTF-16 surrogate: where a body may hold one that pairs with nothing.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
_SURROGATE_ESCAPE_BYTES = re.compile(_SURROGATE_ESCAPE.pattern.encode())


def json_kind(value) -> str:
    """What JSON calls the kind of a decoded value (a client's words, not Python's)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    kinds = {dict: "an object", list: "an array", str: "a string", int: "a number"}
    return kinds.get(type(value), "a number")


def check_unicode(raw: bytes | str, value) -> None:
    """A 400 naming the field if decoded JSON `value` holds a lone surrogate (`\\ud800`,
    which JSON's escapes allow and no UTF-8 text can hold: a tokenizer or a reply would
    fail on it); `raw`, its text, is searched first for such an escape."""
    escape = _SURROGATE_ESCAPE_BYTES if isinstance(raw, bytes) else _SURROGATE_ESCAPE
    if escape.search(raw) is None:
        return
    pending = [((), value)]
    while pending:
        loc, item = pending.pop()
        if isinstance(item, dict):
            for key, inner in item.items():
                pending += [((*loc, key), key), ((*loc, key), inner)]
        elif isinstance(item, list):
            pending.extend(((*loc, i), inner) for i, inner in enumerate(item))
        elif isinstance(item, str) and not _encodes(item):
            where = _path(loc).encode("utf-8", "backslashreplace").decode()  # (a key may hold it)
            raise bad_request(
                f"'{where}' is not valid Unicode: it holds a lone surrogate (a \\ud800-"
                "\\udfff escape that is not one half of a pair)",
                param=where,
            )


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")


async def parse_form(request, what: str, max_files: int, max_fields: int, kinds=FORM_TYPES):
    """A request's form (the caller closes it), or a 400: its content type is not one of
    `kinds` (`what` says what such a request is), or the body does not parse."""
    from starlette.requests import ClientDisconnect

    if not request.headers.get("content-type", "").startswith(kinds):
        raise bad_request(what, code="invalid_content_type")
    try:
        return await request.form(max_files=max_files, max_fields=max_fields)
    except (ClientDisconnect, APIError):  # gone, or the body grew past the limit: 413
        raise
    except Exception as err:  # python-multipart's errors for a malformed body
        raise bad_request(f"the multipart body does not parse: {err}") from None


def merge_extra_body(body: dict) -> dict:
    """A nested `extra_body` object merged into the request, as the OpenAI SDK does when it
    sends one (a field given both ways must agree)."""
    extra = body.get("extra_body")
    if extra is None:
        return body
    if not isinstance(extra, dict):
        raise bad_request("'extra_body' must be an object", param="extra_body")
    if "extra_body" in extra:
        # Merged, it would become the request's `extra_body` field again and be read by no
        # one: every field in it silently dropped. The SDK never nests it.
        raise bad_request(
            "'extra_body.extra_body': extra_body is merged into the request once; put its "
            "fields in 'extra_body' itself",
            param="extra_body.extra_body",
        )
    merged = {k: v for k, v in body.items() if k != "extra_body"}
    for key, value in extra.items():
        if key in merged and merged[key] != value:
            raise bad_request(
                f"'{key}' is given at the top level and in 'extra_body' with different values",
                param=f"extra_body.{key}",
            )
        merged[key] = value
    return merged


def validate(model: type[BaseModel], body: dict):
    """`body` as `model`, or a 400 naming the first field that does not fit."""
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise validation_error(err.errors()) from None
    except RecursionError:
        raise bad_request("the body is nested too deeply") from None


def validation_error(errors) -> Exception:
    # The deepest error first: a value a union takes in one of its forms fails every other
    # form too (`content` as a list of parts is also "not a valid string"), and the error
    # inside the form it was given says what is wrong.
    first = max(errors, key=lambda e: len(_fields(e.get("loc", ()))))
    where = _location(first.get("loc", ()))
    message = first.get("msg", "invalid")
    if first.get("type") == "extra_forbidden":
        message = "unknown field"
    elif first.get("type") == "missing":
        message = "required field is missing"
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return bad_request(f"'{where}': {message}{more}", param=where or None)


def _location(loc) -> str:
    """A pydantic error location as the field's path (`_path`)."""
    return _path(_fields(loc))


def _fields(loc) -> list:
    """A pydantic error location's keys and indexes, without its `body` and union-member
    tags (a tagged union's member goes by its tag's value: the key after the union's)."""
    fields, tagged = [], False
    for part in loc:
        if part == "body" or _is_variant_tag(part):
            tagged = tagged or "tagged-union[" in str(part)
        elif tagged and not isinstance(part, int):
            tagged = False
        else:
            fields.append(part)
    return fields


def _path(parts) -> str:
    """`messages[0].content`: a field's path from its keys and list indexes."""
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def _is_variant_tag(part) -> bool:
    """pydantic names union members in error locations (`list[...]`, `str`, `text`...)."""
    return isinstance(part, str) and (
        "[" in part or part in ("str", "int", "float", "bool", "dict", "list", "URL")
    )
