"""The two schemas of OpenAI's realtime protocol a `/v1/realtime` session speaks — the beta one
and today's (GA) one — and the translation between them. realtime.py works in the beta
schema's names (flat `voice`, `modalities`, `max_response_output_tokens`,
`input_audio_format` ...); here a client's settings in GA names are translated on the way in,
and every server event is renamed and reshaped on the way out.

Which schema a session answers in (docs/server.md, "Realtime sessions"): beta until a
`session.update` or `response.create` uses a GA-only form (`session.type`,
`output_modalities`, `max_output_tokens`, the nested `audio` object), GA from that event on
(a client that has spoken GA once reads GA). `session.created`, sent before the client has said
anything, carries the settings in both forms.
"""

from __future__ import annotations

import json

from omniflow.server.errors import bad_request

# Where each setting lives in the GA schema, by its beta name (the names realtime.py keeps).
GA_PATHS = {
    "modalities": ("output_modalities",),
    "max_response_output_tokens": ("max_output_tokens",),
    "voice": ("audio", "output", "voice"),
    "output_audio_format": ("audio", "output", "format"),
    "input_audio_format": ("audio", "input", "format"),
    "turn_detection": ("audio", "input", "turn_detection"),
}
GA_ONLY = {"type", "output_modalities", "max_output_tokens", "audio"}
# Server events whose GA names differ; conversation.item.created is GA's .added then .done.
GA_EVENTS = {
    f"response.{beta}.{end}": f"response.output_{beta}.{end}"
    for beta in ("text", "audio", "audio_transcript")
    for end in ("delta", "done")
}
GA_CONTENT = {"text": "output_text", "audio": "output_audio"}  # an assistant's parts
PCM16 = "pcm16"  # the beta name of the one audio format: 16-bit mono PCM


def speaks_ga(settings: dict, within: str) -> bool:
    """Whether a `session` or `response` object uses a form only the GA schema has."""
    return any(key in GA_ONLY for key in settings if key != "type" or within == "session")


def from_ga(settings: dict, within: str, allowed: tuple[str, ...], rates: dict) -> dict:
    """`settings` (a `session.update`'s session or a `response.create`'s response) with its GA
    forms in beta names; beta names and unknown fields pass through (realtime.py checks them).
    `rates` are the audio's sample rates each way (`input`, `output`) the formats must name."""
    if within == "session" and "type" in settings and settings["type"] != "realtime":
        raise bad_request(
            f"'{within}.type' is \"realtime\" here (transcription sessions are not served)",
            param=f"{within}.type",
        )
    flat = {k: v for k, v in settings.items() if k not in GA_ONLY}
    paths = {GA_PATHS[key]: key for key in allowed if key in GA_PATHS}
    _known(settings, within, {path[: i + 1] for path in paths for i in range(len(path))})
    for path, key in paths.items():
        value, found = _at(settings, path)
        if not found:
            continue
        where = ".".join((within, *path))
        if key in flat:
            raise bad_request(
                f"'{within}.{key}' and '{where}' name one setting; send one", param=where
            )
        if key == "modalities" and value == ["audio"]:  # GA: audio means audio and transcript
            value = ["text", "audio"]
        elif key.endswith("audio_format") and value is not None:
            value = _beta_format(value, where, rates[key.partition("_")[0]])
        flat[key] = value
    return flat


def field_names(allowed: tuple[str, ...], within: str, ga: bool) -> str:
    """What a `session` or `response` object takes, in the session's schema's names."""
    if not ga:
        return ", ".join(allowed)
    names = ["type"] if within == "session" else []
    names += [".".join(GA_PATHS.get(key, (key,))) for key in allowed]
    return ", ".join(names)


def outgoing(kind: str, fields: dict, ga: bool) -> list[tuple[str, dict]]:
    """The server event(s) `kind` with `fields` (built in beta form) become for a session that
    speaks GA (`ga`) or beta."""
    if kind == "session.created":  # before the client has said which schema it speaks
        return [(kind, {**fields, "session": {**fields["session"], **_ga_session(fields)}})]
    if not ga:
        return [(kind, fields)]
    if kind == "session.updated":
        return [(kind, {**fields, "session": _ga_session(fields)})]
    if kind == "error":
        return [(kind, {**fields, "error": _ga_error(fields["error"])})]
    if "item" in fields:
        fields = {**fields, "item": _ga_item(fields["item"])}
    if "response" in fields:
        output = [_ga_item(item) for item in fields["response"]["output"]]
        fields = {**fields, "response": {**fields["response"], "output": output}}
    if kind == "conversation.item.created":
        return [("conversation.item.added", fields), ("conversation.item.done", fields)]
    return [(GA_EVENTS.get(kind, kind), fields)]


def _known(settings: dict, within: str, paths: set[tuple[str, ...]]) -> None:
    """Refuse a field of the nested `audio` object this server does not take."""
    stack = [(("audio",), settings.get("audio"))] if "audio" in settings else []
    while stack:
        path, value = stack.pop()
        where = ".".join((within, *path))
        if path not in paths:
            raise bad_request(
                f"'{where}' is not supported; {within}.audio takes "
                + ", ".join(".".join(p[1:]) for p in sorted(paths) if len(p) == 3),
                param=where,
                code="unknown_parameter",
            )
        if any(p[: len(path)] == path and len(p) > len(path) for p in paths):
            if not isinstance(value, dict):
                raise bad_request(f"'{where}' is an object", param=where)
            stack += [((*path, key), inner) for key, inner in value.items()]


def _at(settings: dict, path: tuple[str, ...]):
    """The value at `path` in nested `settings`, and whether it is there."""
    for key in path[:-1]:
        settings = settings.get(key) or {}
    return settings.get(path[-1]), path[-1] in settings


def _beta_format(value, where: str, rate: int | None) -> str:
    """A GA audio format object as the beta name of the one format served: 16-bit PCM at the
    session's rate that way."""
    if (isinstance(value, dict) and value.get("type") == "audio/pcm"
            and value.get("rate", rate) in (rate, None) and set(value) <= {"type", "rate"}):  # fmt: skip
        return PCM16
    raise bad_request(
        f"'{where}' is {json.dumps(_ga_format(PCM16, rate))} here (16-bit mono PCM)",
        param=where,
    )


def _ga_format(value, rate: int | None):
    if value != PCM16:
        return value
    return {"type": "audio/pcm", "rate": rate} if rate else {"type": "audio/pcm"}


def _ga_session(fields: dict) -> dict:
    """The session object (beta form, with omniflow's `input_audio_rate`/`output_audio_rate`)
    in the GA form: the rates go into the formats."""
    beta = dict(fields["session"])
    rates = {"input": beta.pop("input_audio_rate"), "output": beta.pop("output_audio_rate")}
    ga = {"type": "realtime"}
    for key, value in beta.items():
        path = GA_PATHS.get(key)
        if path is None:
            ga[key] = value
            continue
        if key == "modalities":
            value = ["audio"] if "audio" in value else value
        elif key.endswith("audio_format"):
            value = _ga_format(value, rates[key.partition("_")[0]])
        inner = ga
        for step in path[:-1]:
            inner = inner.setdefault(step, {})
        inner[path[-1]] = value
    return ga


def _ga_item(item: dict) -> dict:
    if item.get("role") != "assistant":
        return item
    content = [{**part, "type": GA_CONTENT.get(part["type"], part["type"])}
               for part in item["content"]]  # fmt: skip
    return {**item, "content": content}


def _ga_error(error: dict) -> dict:
    """An error naming a setting by its beta name (`session.voice`), named by its GA path."""
    within, _, key = (error.get("param") or "").partition(".")
    if within not in ("session", "response") or key not in GA_PATHS:
        return error
    beta, ga = f"{within}.{key}", ".".join((within, *GA_PATHS[key]))
    return {**error, "param": ga, "message": error["message"].replace(f"'{beta}'", f"'{ga}'")}
