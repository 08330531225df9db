"""`WebSocket /v1/realtime?model=NAME`: a voice conversation over one socket, in the subset
of OpenAI's realtime event protocol that docs/server.md ("Realtime sessions") lists.

The client sends JSON events: `session.update`, `input_audio_buffer.append` (base64 16-bit
PCM, mono, 16 kHz) / `.commit` / `.clear`, `conversation.item.create` / `.delete`,
`response.create`, `response.cancel`. The server answers with `session.created` / `.updated`,
`input_audio_buffer.committed` / `.cleared`, `conversation.item.created` / `.deleted`,
`response.created`, `response.text.delta` or (when the response speaks)
`response.audio_transcript.delta` and `response.audio.delta` (base64 16-bit PCM at the
pipeline's rate), their `.done` events, `response.done` (status and usage), and `error`.
This module works in the beta schema's names; realtime_schema.py translates a client's
settings in today's (GA) names on the way in and, for a client that speaks GA, every event on
the way out.

A response is one chat request made of the conversation so far (the session's
`instructions` as its system message, every item since) and parsed, admitted and run
exactly as `POST /v1/chat/completions` streams one (chat.py), so it batches with every other
request in every stage; a committed audio buffer is a user message with an `input_audio`
part, which a pipeline that takes no audio refuses (an `error` naming the item). The
assistant's reply, however far it got, joins the conversation as an item (its place is
kept while it runs).

One response runs at a time. `response.cancel`, or, with `turn_detection` set, new audio
appended while a response runs (barge-in; there is no voice-activity detection: the client
decides what is speech), cancels it in every stage at once and it ends `cancelled`. A
client that goes away cancels it too, and frees its admission slot. A mistaken event is an
`error` event and the session goes on; settings are checked against the pipeline when they
are set, so a bad one never reaches a response. What a session keeps is bounded (the audio
buffer, the conversation's items, their audio and text, one event's size), as are the
sessions a server holds at once and how long one may sit idle (`ServerConfig`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
import uuid

import torch
from starlette.websockets import WebSocket, WebSocketDisconnect

from omniflow.media import audio_bytes
from omniflow.server import chat, realtime_schema
from omniflow.server.errors import APIError, bad_request
from omniflow.server.sockets import (
    CLOSE_BAD_REQUEST,
    CLOSE_BUSY,
    IdleReceiver,
    Sender,
    client_message,
    close_session,
    end_run,
    open_session,
    refused,
)

log = logging.getLogger("omniflow.server")
PATH = "/v1/realtime"
INPUT_RATE = 16000  # input_audio_format pcm16: 16-bit mono at 16 kHz
MAX_EVENT_BYTES = 4 << 20  # one client event (an append of ~2 minutes of audio)
MAX_BUFFER_BYTES = 4 << 20  # the uncommitted audio buffer (~2 minutes)
MAX_ITEMS = 64  # conversation items a session keeps
MAX_CONVERSATION_AUDIO_BYTES = 16 << 20  # the committed audio every item holds (~8 minutes)
SESSION_FIELDS = (
    "modalities",
    "instructions",
    "voice",
    "temperature",
    "max_response_output_tokens",
    "input_audio_format",
    "output_audio_format",
    "turn_detection",
)
RESPONSE_FIELDS = ("modalities", "instructions", "voice", "temperature",
                   "max_response_output_tokens", "output_audio_format")  # fmt: skip
# The chat request's fields the settings become: a refusal of one names the setting.
CHAT_FIELDS = {
    "audio.voice": "voice",
    "temperature": "temperature",
    "max_tokens": "max_response_output_tokens",
    "modalities": "modalities",
}
# What a settings check asks the pipeline to answer: one user word (and a tenth of a second
# of silence where it must hear something); the conversation is checked when answered.
PROBE_TEXT = {"type": "input_text", "text": "."}
PROBE_AUDIO = {"type": "input_audio", "audio": ""}  # filled in on first use


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def _invalid(message: str, param: str, code: str = "invalid_value") -> APIError:
    return bad_request(message, param=param, code=code)


def _about_settings(err: APIError, overridden=(), within: str = "session") -> APIError:
    """A chat request's refusal of a field a setting became, named as that setting: the
    response's own where it overrode it, else the session's."""
    key = CHAT_FIELDS.get(err.param or "")
    if key is not None:
        err.param = f"{'response' if key in overridden else within}.{key}"
        err.message = f"'{err.param}': {err.message}"
    return err


def _long_enough(samples: int, where: str) -> None:
    """A clip (PCM16 at INPUT_RATE) of at least one window of the speech encoders' front end
    (`chat.MIN_CLIP_SAMPLES`), refused as the event that brings it: a shorter one failed
    every response of the conversation later, in the chat request's words."""
    if samples < chat.MIN_CLIP_SAMPLES:
        raise _invalid(
            f"'{where}' holds {samples / INPUT_RATE * 1000:.1f} ms of audio; a clip is at least "
            f"{chat.MIN_CLIP_SAMPLES / INPUT_RATE * 1000:g} ms",
            where,
        )


def _about_items(err: APIError, sources: list[str]) -> APIError:
    """A chat request's refusal, its `messages[i]...` field named as the item it came from
    (a refusal of the whole `messages`, as "takes no audio input", names every item with
    audio)."""
    param = err.param or ""
    if param.startswith("messages["):
        index = int(param[len("messages[") : param.index("]")])
        err.param = sources[index].removesuffix("+audio")
    elif param == "messages":
        named = [s.removesuffix("+audio") for s in sources if s.endswith("+audio")]
        err.param = ", ".join(named or [s.removesuffix("+audio") for s in sources])
    if err.param != param:
        err.message = f"{err.param}: {err.message}"
    return err


class RealtimeSession:
    """One WebSocket's conversation (see the module doc)."""

    def __init__(self, server, websocket: WebSocket):
        self.server = server
        self.ws = websocket
        self.id = _id("sess")
        self.served = None
        self.out: Sender | None = None
        self.config: dict = {}
        self.buffer = bytearray()  # uncommitted input audio
        self.items: list[dict] = []  # the conversation: realtime items, in order
        self.audio_bytes = 0  # committed audio the items hold
        self.response: tuple[str, asyncio.Task] | None = None  # the running one
        self.inbox: IdleReceiver | None = None  # the client's events, until idle too long
        self.cancel_reason = "client_cancelled"  # why the running one was cancelled
        self.ga = False  # whether the client speaks today's schema (realtime_schema.py)

    # --- the socket -----------------------------------------------------------------------------
    async def serve(self) -> None:
        if await refused(self.server, self.ws):
            return
        try:
            self.served = self.server.route(self.ws.query_params.get("model"), "chat")
        except APIError as err:
            await self.ws.close(code=CLOSE_BAD_REQUEST, reason=err.message[:120])
            return
        await self.ws.accept()
        self.out = Sender(self.ws)
        config = self.server.config
        full = open_session(self.server, PATH, config.max_realtime_sessions,
                            "--max-realtime-sessions")  # fmt: skip
        if full is not None:
            self._error(full)
            await self._close(CLOSE_BUSY, "too many sessions")
            return
        self.inbox = IdleReceiver(
            self.ws, config.realtime_idle_timeout_s, lambda: self.response is not None
        )
        gauge = self.server.metrics.websocket_sessions.labels(self.served.name, PATH)
        gauge.inc()
        self.config = self._default_config()
        self.send("session.created", session=self._session())
        closing = None
        try:
            closing = await self._read_loop()
        except WebSocketDisconnect:
            pass
        finally:
            await self._cancel_response()
            close_session(self.server, PATH)  # before the close: the client may reconnect
            gauge.dec()
            if closing is not None:
                await self._close(*closing)
            await self.out.stop()

    async def _close(self, code: int, reason: str) -> None:
        """Close the socket once what was queued to send has gone."""
        self.out.close(code, reason)
        await self.out.flush()
        await self.out.stop()

    async def _read_loop(self) -> tuple[int, str]:
        """Client events until the client goes away (WebSocketDisconnect), or the session
        has been idle too long: then the close code and reason."""
        while True:
            message = await self.inbox.receive()
            if message is None:
                idle_s = self.server.config.realtime_idle_timeout_s
                self._error(_invalid(f"the session was idle for {idle_s:g} s "
                                     "(--realtime-idle-timeout): closed", "type",
                                     "session_expired"))  # fmt: skip
                return 1000, "idle"
            if message["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(message.get("code", 1000))
            event_id = None
            try:
                event = self._event(message)
                event_id = event.get("event_id")
                await self._handle(event)
            except APIError as err:
                self._error(err, event_id)
            except Exception as err:  # a bug of ours: the log has it, the session goes on
                log.exception("internal error in a realtime event")
                self._error(_internal(err), event_id)

    def send(self, kind: str, **fields) -> None:
        for name, body in realtime_schema.outgoing(kind, fields, self.ga):
            self.out.json({"type": name, "event_id": _id("event"), **body})

    def _error(self, err: APIError, event_id: str | None = None) -> None:
        error = dict(err.body()["error"])
        error["type"] = "invalid_request_error" if err.status < 500 else "server_error"
        if event_id is not None:
            error["event_id"] = event_id
        self.send("error", error=error)

    # --- client events --------------------------------------------------------------------------
    def _event(self, message: dict) -> dict:
        return client_message(message, MAX_EVENT_BYTES, "event")

    async def _handle(self, event: dict) -> None:
        kind = event["type"]
        handler = {
            "session.update": self._session_update,
            "input_audio_buffer.append": self._append,
            "input_audio_buffer.commit": self._commit,
            "input_audio_buffer.clear": self._clear,
            "conversation.item.create": self._item_create,
            "conversation.item.delete": self._item_delete,
            "response.create": self._response_create,
            "response.cancel": self._response_cancel,
        }.get(kind)
        if handler is None:
            raise _invalid(
                f"unknown event type {kind!r}; this server takes session.update, "
                "input_audio_buffer.append/commit/clear, conversation.item.create/delete, "
                "response.create and response.cancel",
                "type",
            )
        await handler(event)

    async def _session_update(self, event: dict) -> None:
        update = event.get("session")
        if not isinstance(update, dict):
            raise _invalid("session.update takes a 'session' object", "session")
        update = self._beta(update, SESSION_FIELDS, "session")
        config = self._merged(update, SESSION_FIELDS, "session")
        self._check_text(self._text_held(config), "session.instructions")
        # Checked against the pipeline now (an unknown voice, a token limit beyond the plan):
        # a setting kept unchecked would fail every later response, far from its cause.
        await self._check_settings(config)
        self.config = config
        self.send("session.updated", session=self._session())

    async def _check_settings(self, config: dict, overridden=()) -> None:
        content = [PROBE_TEXT]
        if any(p.default is None and not getattr(p, "optional", False)
               for p in self.served.inputs_of("audio")):  # fmt: skip
            if not PROBE_AUDIO["audio"]:
                silence = audio_bytes(torch.zeros(INPUT_RATE // 10, dtype=torch.int16),
                                      INPUT_RATE, "wav")  # fmt: skip
                PROBE_AUDIO["audio"] = base64.b64encode(silence).decode()
            content.append(PROBE_AUDIO)
        body, _ = self._chat_body(config, [{"id": "probe", "role": "user", "content": content}])
        try:
            job = await chat.parse(self.server, self.served, body)
            self.server.admit(self.served, job.inputs, job.params, job.outputs)
        except APIError as err:
            if err.code == "context_length_exceeded":  # the instructions alone are too long
                raise _invalid(f"'session.instructions': {err.message}", "session.instructions",
                               err.code) from None  # fmt: skip
            if err.param not in CHAT_FIELDS:
                return  # about the stand-in conversation, not a setting
            raise _about_settings(err, overridden) from None

    def _beta(self, update: dict, allowed: tuple[str, ...], within: str) -> dict:
        """`update` (a `within` object from the client, in either schema's names) in the beta
        names this module keeps; a GA form in it makes the session answer in GA."""
        self.ga = self.ga or realtime_schema.speaks_ga(update, within)
        rates = {"input": INPUT_RATE, "output": self._output_rate()}
        return realtime_schema.from_ga(update, within, allowed, rates)

    def _merged(self, update: dict, allowed: tuple[str, ...], within: str) -> dict:
        """The session's settings with `update` (the `within` object's fields, each checked)."""
        config = dict(self.config)
        for key, value in update.items():
            if key not in allowed:
                names = realtime_schema.field_names(allowed, within, self.ga)
                raise _invalid(
                    f"'{within}.{key}' is not supported; {within} takes {names}",
                    f"{within}.{key}",
                    "unknown_parameter",
                )
            config[key] = self._session_value(key, value, within)
        return config

    def _session_value(self, key: str, value, within: str):
        """`value` for the session's (or one response's) `key`, checked."""
        where = f"{within}.{key}"
        if value is None and key != "turn_detection":  # null: back to the default
            return self._default_config()[key]
        if key == "modalities":
            have = {"text"} | ({"audio"} if self.served.outputs_of("audio") else set())
            if (not isinstance(value, list) or not value
                    or not all(isinstance(m, str) for m in value) or not set(value) <= have):  # fmt: skip
                raise _invalid(
                    f"'{where}' lists what the response gives: {sorted(have)} here", where
                )
            return value
        if key in ("input_audio_format", "output_audio_format"):
            if value != "pcm16":
                raise _invalid(f"'{where}' is pcm16 (16-bit mono PCM) here", where)
            return value
        if key == "turn_detection":
            if value is not None and not (isinstance(value, dict) and value.get("type")):
                raise _invalid(f"'{where}' is null or an object with a 'type'", where)
            return value
        if key == "max_response_output_tokens":
            if value != "inf" and (isinstance(value, bool) or not isinstance(value, int)):
                raise _invalid(f"'{where}' is a count of tokens or \"inf\"", where)
            return value
        if key == "temperature":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _invalid(f"'{where}' is a number", where)
            return value
        if not isinstance(value, str):
            raise _invalid(f"'{where}' is a string", where)
        return value

    async def _append(self, event: dict) -> None:
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise _invalid("input_audio_buffer.append takes 'audio' (base64 PCM16)", "audio")
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise _invalid("'audio' is not valid base64", "audio") from None
        if len(data) % 2:
            raise _invalid("'audio' is 16-bit PCM: an even number of bytes", "audio")
        if len(self.buffer) + len(data) > MAX_BUFFER_BYTES:
            raise _invalid(
                f"the input audio buffer holds at most {MAX_BUFFER_BYTES} bytes "
                f"({MAX_BUFFER_BYTES // (2 * INPUT_RATE)} s); commit or clear it",
                "audio",
                "buffer_full",
            )
        if self.response is not None and self.config.get("turn_detection") and data:
            await self._cancel_response("turn_detected")  # barge-in: the user speaks over it
        self.buffer += data

    async def _commit(self, event: dict) -> None:
        if not self.buffer:
            raise _invalid("the input audio buffer is empty", "type", "input_audio_buffer_empty")
        _long_enough(len(self.buffer) // 2, "input_audio_buffer")
        self._takes_audio("input_audio_buffer")
        wav = audio_bytes(
            torch.frombuffer(bytearray(self.buffer), dtype=torch.int16), INPUT_RATE, "wav"
        )
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_audio", "audio": base64.b64encode(wav).decode()}],
        }
        added = self._add_item(item)
        self.buffer.clear()
        self.send("input_audio_buffer.committed", previous_item_id=added["previous"],
                  item_id=added["item"]["id"])  # fmt: skip
        self._announce(added)
        if self.config.get("turn_detection"):  # a turn ends: it is answered, as VAD would
            await self._cancel_response("turn_detected")
            await self._response_create({})

    async def _clear(self, event: dict) -> None:
        self.buffer.clear()
        self.send("input_audio_buffer.cleared")

    async def _item_create(self, event: dict) -> None:
        item = event.get("item")
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise _invalid("conversation.item.create takes a message 'item'", "item")
        role = item.get("role")
        if role not in ("user", "assistant", "system"):
            raise _invalid("'item.role' is user, assistant or system", "item.role")
        content = item.get("content")
        if not isinstance(content, list) or not content:
            raise _invalid("'item.content' is a list of parts", "item.content")
        for j, part in enumerate(content):
            where = f"item.content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "text", "output_text"):  # output_text: GA's assistant text
                if not isinstance(part.get("text"), str):
                    raise _invalid(f"'{where}.text' is a string", f"{where}.text")
            elif kind == "input_audio" and role == "user":
                self._takes_audio(where)
                # An item's audio is base64 PCM16 at 16 kHz, as the buffer's: kept as a WAV.
                pcm = await self._append_part(part, where)
                part["audio"] = base64.b64encode(audio_bytes(pcm, INPUT_RATE, "wav")).decode()
            else:
                raise _invalid(
                    f"'{where}.type' is input_text, text, output_text or (a user's) input_audio",
                    where,
                )
        added = self._add_item({"type": "message", "role": role, "content": content},
                               item_id=item.get("id"), at=self._after(event))  # fmt: skip
        self._announce(added)

    def _after(self, event: dict) -> int | None:
        """Where `conversation.item.create`'s `previous_item_id` puts the item: after that
        item, first for "root", last (None) without one; an item the conversation does not
        have is an error naming it."""
        previous = event.get("previous_item_id")
        if previous is None:
            return None
        if previous == "root":
            return 0
        ids = [i["id"] for i in self.items]
        if previous not in ids:
            raise _invalid(
                f"the conversation has no item {previous!r} to put the item after",
                "previous_item_id",
            )
        return ids.index(previous) + 1

    async def _item_delete(self, event: dict) -> None:
        """What keeps a long conversation within its bounds: the client drops old items."""
        item_id = event.get("item_id")
        if not isinstance(item_id, str):
            raise _invalid(f"'item_id' must be an item's id, not {item_id!r}", "item_id")
        found = [item for item in self.items if item["id"] == item_id]
        if not found:
            raise _invalid(f"the conversation has no item {item_id!r}", "item_id", "item_not_found")
        self.items.remove(found[0])
        self.audio_bytes -= _audio_of(found[0])
        self.send("conversation.item.deleted", item_id=item_id)

    def _takes_audio(self, where: str) -> None:
        """Audio joins the conversation only where the pipeline hears: else every later
        response would be refused for it."""
        if not self.served.inputs_of("audio"):
            raise _invalid(
                f"'{where}': pipeline '{self.served.name}' takes no audio input (its inputs: "
                f"{', '.join(f'{p.name} ({p.type})' for p in self.served.plan.inputs)}); "
                "send input_text items",
                where,
                "audio_not_supported",
            )

    async def _append_part(self, part: dict, where: str) -> torch.Tensor:
        try:
            data = base64.b64decode(part.get("audio") or "", validate=True)
        except (binascii.Error, ValueError, TypeError):
            raise _invalid(f"'{where}.audio' is not valid base64", f"{where}.audio") from None
        if not data or len(data) % 2:
            raise _invalid(f"'{where}.audio' is 16-bit PCM, not empty", f"{where}.audio")
        _long_enough(len(data) // 2, f"{where}.audio")
        return torch.frombuffer(bytearray(data), dtype=torch.int16)

    def _add_item(self, item: dict, item_id=None, at: int | None = None) -> dict:
        """`item` into the conversation, at index `at` (None: last)."""
        # A running response's reply has its place kept: it joins when the response ends.
        if len(self.items) + (self.response is not None) >= MAX_ITEMS:
            raise _invalid(
                f"a session keeps at most {MAX_ITEMS} conversation items; delete some "
                "(conversation.item.delete) or start a new session",
                "item",
                "conversation_full",
            )
        self._check_text(self._text_held(self.config) + _text_of(item), "item")
        held = _audio_of(item)
        if self.audio_bytes + held > MAX_CONVERSATION_AUDIO_BYTES:
            raise _invalid(
                f"a session keeps at most {MAX_CONVERSATION_AUDIO_BYTES} bytes of audio; "
                "delete some items (conversation.item.delete) or start a new session",
                "item",
                "conversation_full",
            )
        if item_id is not None and not isinstance(item_id, str):
            raise _invalid("'item.id' is a string", "item.id")
        if item_id is not None and any(i["id"] == item_id for i in self.items):
            raise _invalid(f"the conversation has an item {item_id!r} already", "item.id")
        at = len(self.items) if at is None else at
        previous = self.items[at - 1]["id"] if at else None
        item = {"id": item_id or _id("item"), "object": "realtime.item", "status": "completed",
                **item}  # fmt: skip
        self.items.insert(at, item)
        self.audio_bytes += held
        return {"previous": previous, "item": item}

    def _text_held(self, config: dict) -> int:
        """The characters of text the session holds with `config`: its instructions and
        every item's text."""
        return len(config.get("instructions") or "") + sum(map(_text_of, self.items))

    def _check_text(self, held: int, param: str) -> None:
        limit = self.server.config.max_realtime_text
        if held > limit:
            raise _invalid(
                f"a session holds at most {limit} characters of text, its instructions and "
                f"items' (--max-realtime-text), not {held}; delete some items "
                "(conversation.item.delete) or start a new session",
                param,
                "conversation_full",
            )

    def _announce(self, added: dict) -> None:
        item = dict(added["item"])
        # The audio itself is not echoed back: the client sent it.
        item["content"] = [
            {k: v for k, v in part.items() if k != "audio"} for part in item["content"]
        ]
        self.send("conversation.item.created", previous_item_id=added["previous"], item=item)

    # --- responses ------------------------------------------------------------------------------
    async def _response_create(self, event: dict) -> None:
        if self.response is not None:
            raise _invalid(
                "a response is running; cancel it first (response.cancel)",
                "type",
                "conversation_already_has_active_response",
            )
        options = event.get("response") or {}
        if not isinstance(options, dict):
            raise _invalid("'response' is an object", "response")
        if len(self.items) >= MAX_ITEMS:  # its reply would have no place in the conversation
            raise _invalid(
                f"the conversation holds {MAX_ITEMS} items, its limit; delete some "
                "(conversation.item.delete) or start a new session",
                "type",
                "conversation_full",
            )
        options = self._beta(options, RESPONSE_FIELDS, "response")
        config = self._merged(options, RESPONSE_FIELDS, "response")
        within = "response" if "instructions" in options else "session"
        body, sources = self._chat_body(config, self.items, f"{within}.instructions")
        try:  # checked now: a bad item fails before any work starts
            job = await chat.parse(self.server, self.served, body)
            admitted = self.server.admit(self.served, job.inputs, job.params, job.outputs)
        except APIError as err:
            raise _about_items(_about_settings(err, options), sources) from None
        response_id = _id("resp")
        self.send("response.created", response=self._response(response_id, "in_progress"))
        task = asyncio.ensure_future(self._respond(response_id, job, admitted, config))
        self.response = (response_id, task)

    def _chat_body(
        self, config: dict, items: list[dict], instructions: str = "session.instructions"
    ) -> tuple[dict, list[str]]:
        """The chat request of a conversation (`items`), and what each of its messages came from
        (`item ID`; with "+audio" where the item holds audio; the instructions' field
        `instructions`: the session's, or the response's own). A request carries as many
        clips as the pipeline takes (`_clips_per_request`): the newest audio parts go as
        audio, earlier spoken turns are in the conversation through the replies to them."""
        messages, sources = [], []
        if config.get("instructions"):
            messages.append({"role": "system", "content": config["instructions"]})
            sources.append(instructions)
        clips = sum(p["type"] == "input_audio" for item in items for p in item["content"])
        room = _clips_per_request(self.served)
        skip = 0 if room is None else max(0, clips - room)
        for item in items:
            parts = []
            for part in item["content"]:
                if part["type"] != "input_audio":
                    parts.append({"type": "text", "text": part.get("text") or
                                  part.get("transcript") or ""})  # fmt: skip
                elif skip:
                    skip -= 1
                else:
                    parts.append({"type": "input_audio",
                                  "input_audio": {"data": part["audio"], "format": "wav"}})  # fmt: skip
            if not parts:
                continue
            source = f"item {item['id']}"
            if all(p["type"] == "text" for p in parts):
                content = "\n".join(p["text"] for p in parts)
            else:
                content, source = parts, source + "+audio"
            messages.append({"role": item["role"], "content": content})
            sources.append(source)
        if not any(m["role"] == "user" for m in messages):
            raise _invalid("the conversation has no user item to answer yet", "type")
        body = {"model": self.served.name, "messages": messages, "stream": True,
                "modalities": config["modalities"]}  # fmt: skip
        if "audio" in config["modalities"]:
            body["audio"] = {"format": "pcm16"}
            if config.get("voice"):
                body["audio"]["voice"] = config["voice"]
        if config.get("temperature") is not None:
            body["temperature"] = config["temperature"]
        if isinstance(config.get("max_response_output_tokens"), int):
            body["max_tokens"] = config["max_response_output_tokens"]
        return body, sources

    async def _respond(self, response_id: str, job, admitted, config: dict) -> None:
        """Run the response: its deltas out as they come, then its item and response.done."""
        served, began = self.served, time.perf_counter()
        speaks = "audio" in config["modalities"]
        item_id, text, run, slot, status, outcome = _id("item"), [], None, None, 200, "completed"
        reason = None
        ids = {"response_id": response_id, "item_id": item_id, "output_index": 0,
               "content_index": 0}  # fmt: skip
        try:
            slot = await served.acquire()  # queued like any request while the pipeline is full
            run = chat.make_run(job, admitted, response_id, began)
            run.timeline.queued = slot.waited
            async for output, value in run.chunks():
                if job.want_text and output == job.text_port.name:
                    text.append(value)
                    kind = "response.audio_transcript.delta" if speaks else "response.text.delta"
                    self.send(kind, delta=value, **ids)
                else:
                    data = audio_bytes(value, run.timeline.rate, "pcm")
                    self.send("response.audio.delta", delta=base64.b64encode(data).decode(), **ids)
            if speaks:
                self.send("response.audio.done", **ids)
                self.send("response.audio_transcript.done", transcript="".join(text), **ids)
            else:
                self.send("response.text.done", text="".join(text), **ids)
            if run.finish_reason == "length":
                outcome = "incomplete"
        except APIError as err:
            status, outcome = err.status, "failed"
            self._error(err)
        except Exception as err:  # a bug of ours: the response fails, the session goes on
            log.exception("internal error in a realtime response")
            status, outcome = 500, "failed"
            self._error(_internal(err))
        except asyncio.CancelledError:
            status, outcome = 499, "cancelled"
            reason = self.cancel_reason
        finally:
            await end_run(self.server, PATH, served, run, slot, status, began)
        part = {"type": "audio" if speaks else "text",
                ("transcript" if speaks else "text"): "".join(text)}  # fmt: skip
        item = {"id": item_id, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": "completed" if outcome == "completed" else "incomplete",
                "content": [part]}  # fmt: skip
        if text:  # what the user heard (none: nothing to remember) joins the conversation
            self.items.append(item)
        usage = run.usage if run is not None else None
        response = self._response(response_id, outcome, [item], usage, reason)
        self.send("response.done", response=response)
        self.inbox.touch()
        if self.response is not None and self.response[0] == response_id:
            self.response = None

    async def _response_cancel(self, event: dict) -> None:
        if self.response is None:
            raise _invalid("no response is running", "type", "response_cancel_not_active")
        await self._cancel_response()

    async def _cancel_response(self, reason: str = "client_cancelled") -> None:
        if self.response is None:
            return
        _, task = self.response
        self.cancel_reason = reason
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        self.response = None

    # --- what the server says -------------------------------------------------------------------
    def _default_config(self) -> dict:
        speaks = bool(self.served.outputs_of("audio"))
        return {
            "modalities": ["text", "audio"] if speaks else ["text"],
            "instructions": "",
            "voice": None,
            "temperature": None,
            "max_response_output_tokens": "inf",
            "input_audio_format": "pcm16",
            "output_audio_format": "pcm16",
            "turn_detection": None,
        }

    def _output_rate(self) -> int | None:
        rates = [o.attrs.get("rate") for o in self.served.plan.outputs if o.type == "audio"]
        return int(rates[0]) if rates and rates[0] else None

    def _session(self) -> dict:
        return {
            "id": self.id,
            "object": "realtime.session",
            "model": self.served.name,
            **self.config,
            # omniflow's own: the sample rates of the audio each way.
            "input_audio_rate": INPUT_RATE,
            "output_audio_rate": self._output_rate(),
        }

    def _response(self, response_id: str, status: str, output=(), usage=None, reason=None):
        details = None
        if status == "incomplete":
            details = {"type": "incomplete", "reason": "max_output_tokens"}
        elif status == "cancelled":  # client_cancelled, or turn_detected: a barge-in
            details = {"type": "cancelled", "reason": reason}
        return {
            "id": response_id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": list(output),
            "usage": None if usage is None else _usage(usage),
        }


def _usage(usage: dict) -> dict:
    """A chat reply's usage as a realtime response's: its tokens, and their kinds where they
    are known (the prompt's media placeholders; the talker's codec tokens, beside the
    text's `output_tokens` as chat completions report them: docs/server.md)."""
    told = {
        "total_tokens": usage["total_tokens"],
        "input_tokens": usage["prompt_tokens"],
        "output_tokens": usage["completion_tokens"],
    }
    if media := usage.get("prompt_tokens_details"):
        text = usage["prompt_tokens"] - sum(media.values())
        told["input_token_details"] = {"text_tokens": text, **media}
    if audio := usage.get("completion_tokens_details"):
        told["output_token_details"] = {"text_tokens": usage["completion_tokens"], **audio}
    return told


def _internal(err: Exception) -> APIError:
    return APIError(500, f"internal error: {type(err).__name__}: {err}", code="internal_error")


def _text_of(item: dict) -> int:
    """The characters of text (or transcript) an item holds."""
    return sum(len(p.get("text") or p.get("transcript") or "") for p in item["content"])


def _audio_of(item: dict) -> int:
    """The bytes of audio (base64 WAV) an item holds."""
    return sum(len(p.get("audio") or "") for p in item["content"] if p["type"] == "input_audio")


def _clips_per_request(served) -> int | None:
    """The audio clips one chat request carries, as chat.py's `_media_input` takes them: one
    per audio input, or any number (None) into a lone optional one."""
    ports = served.inputs_of("audio")
    if len(ports) == 1 and getattr(ports[0], "optional", False):
        return None
    return len(ports)
