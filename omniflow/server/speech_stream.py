"""`WebSocket /v1/audio/speech/stream`: text arrives in pieces (as an LLM writes it), audio
goes back as soon as it exists. docs/server.md, "Streaming speech over a WebSocket", has
the protocol; in short:

- the client's messages are JSON text frames: `session.start` (the speech fields of
  `POST /v1/audio/speech` but `input` and `stream`), then any number of `input.text`
  pieces, `input.flush`, `cancel`, and `input.done`;
- the server's audio is binary frames (raw 16-bit PCM, or a WAV stream), its control
  messages JSON text frames: `session.started`, `segment.started`, `segment.done`,
  `cancelled`, `error`, `session.done`.

The text is cut into segments where a sentence ends (or at the last word boundary, where a
sentence runs past `MAX_SEGMENT_CHARS`; `input.flush` and `input.done` end one too), by a
scan linear in the text however it arrives; each segment is one request to the pipeline,
admitted like a `POST /v1/audio/speech` with the session's fields, so segments batch with
every other request in every stage. Up to `AHEAD` segments run at once: the next is being
synthesised while the one before it plays. Their audio goes out in order, each segment's
as its pipeline makes it. The voice (a clone's reference too) is resolved once per session.

What a session holds is bounded: `MAX_BUFFER_CHARS` of text waiting to be spoken (buffered
or in segments not yet done), `MAX_SEGMENTS` such segments, `MAX_MESSAGE_CHARS` a message;
and so is what sessions hold: `--max-speech-sessions` open at once (beyond, an `error` and
1013), each closed after `--speech-idle-timeout` with no message and nothing being spoken.

A client that drops the socket, or sends `cancel`, cancels its segments in every stage;
their admission slots are free within a second. A mistake in a message is an `error`
message (OpenAI's error body: `param` names the field) and the socket closes with 1008; a
pipeline failure closes it with 1011.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field

from starlette.websockets import WebSocket, WebSocketDisconnect

from omniflow.media import Tempo, audio_bytes, streaming_wav_header
from omniflow.server import chat, speech
from omniflow.server.errors import APIError, bad_request
from omniflow.server.run import Run
from omniflow.server.sockets import (
    CLOSE_BAD_REQUEST,
    CLOSE_BUSY,
    CLOSE_FAILED,
    IdleReceiver,
    Sender,
    client_message,
    close_session,
    end_run,
    open_session,
    refused,
)

PATH = "/v1/audio/speech/stream"
STREAM_FORMATS = ("pcm", "wav")
AHEAD = 2  # segments synthesised at once per session
MAX_SEGMENT_CHARS = 240  # past this, a segment ends at a word boundary
MAX_BUFFER_CHARS = 64 << 10  # text waiting to be spoken (buffered, or in segments not done)
# Segments waiting to be spoken: prose averages well over 64 characters a sentence, so this
# never refuses text within MAX_BUFFER_CHARS; it bounds what a text of tiny "sentences" costs.
MAX_SEGMENTS = MAX_BUFFER_CHARS // 64
# One client message: the most text a session holds, JSON-escaped (a \u escape is 6 characters).
MAX_MESSAGE_CHARS = 6 * MAX_BUFFER_CHARS + 1024

# A sentence ends after a run of . ! ? ; … (then any closing quotes or brackets) that white
# space follows, after a run of 。！？； and at a newline. Found by a scan that looks at each
# character a bounded number of times, whatever the text (a regex with a lookahead after a
# repeated class backtracks quadratically on a long run of dots).
_MARK = re.compile(r"[.!?;…。！？；\n]")
_LATIN_END = re.compile(r"[.!?;…]+[\"')\]]*")
_CJK_END = re.compile(r"[。！？；]+")
_SPACE = re.compile(r"\s")


def sentence_end(text: str, start: int, limit: int) -> tuple[int | None, int]:
    """The end of the first sentence of `text` that ends at `limit` at the latest, searched
    from `start`; None if none does (yet). Also where a later search must start again (the
    text grown, or `limit` moved on): no sentence can end between `start` and there."""
    pos = start
    while (mark := _MARK.search(text, pos, limit)) is not None:
        at = mark.start()
        if text[at] == "\n":
            return at + 1, at + 1
        if text[at] in "。！？；":
            end = _CJK_END.match(text, at, limit + 1).end()
            return (end, end) if end <= limit else (None, at)
        end = _LATIN_END.match(text, at, limit + 1).end()
        if end > limit or end == len(text):
            return None, at  # it ends past the limit, or what follows it has not come yet
        if text[end].isspace():
            return end, end
        pos = end
    return None, min(limit, len(text))


def word_end(head: str) -> int:
    """Where text with no sentence end in `head` is cut: after the last white space of
    `head`, else at its end."""
    return max((space.end() for space in _SPACE.finditer(head)), default=len(head))


class Segmenter:
    """Text pieces -> the segments they complete, in order: each ends where a sentence ends,
    or, where none does within MAX_SEGMENT_CHARS, at the last word boundary before that.
    However the text arrives, each character is scanned a bounded number of times (what
    was searched is not searched again when more comes)."""

    def __init__(self):
        self.text = ""
        self.resume = 0  # where the next sentence search starts

    def add(self, piece: str) -> list[str]:
        text, begin, done = self.text + piece, 0, []
        while begin < len(text):
            limit = begin + MAX_SEGMENT_CHARS
            end, self.resume = sentence_end(text, max(self.resume, begin), limit)
            if end is None:
                if len(text) <= limit:
                    break  # the segment may end in text still to come
                end = begin + word_end(text[begin:limit])
            done.append(text[begin:end].strip())
            begin = end
        self.text, self.resume = text[begin:], max(0, self.resume - begin)
        return [s for s in done if s]

    def flush(self) -> str | None:
        text, self.text, self.resume = self.text.strip(), "", 0
        return text or None


@dataclass(eq=False)
class Segment:
    index: int
    text: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # audio, then a last item
    task: asyncio.Task | None = None
    run: Run | None = None


_END = object()


class SpeechSession:
    """One WebSocket's session (see the module doc)."""

    def __init__(self, server, websocket: WebSocket):
        self.server = server
        self.ws = websocket
        self.served = None
        self.config: dict = {}
        self.format = "pcm"
        self.segmenter = Segmenter()
        self.segments: asyncio.Queue = asyncio.Queue()  # in order; None: no more
        self.running: set[Segment] = set()
        self.ahead = asyncio.Semaphore(AHEAD)
        self.out: Sender | None = None
        self.count = 0
        self.audio_seconds = 0.0
        self.header_sent = False
        self.ended = False  # input.done came
        self.speaker: asyncio.Task | None = None

    # --- the socket -----------------------------------------------------------------------------
    async def serve(self) -> None:
        if await refused(self.server, self.ws):
            return
        await self.ws.accept()
        self.out = Sender(self.ws)
        config = self.server.config
        full = open_session(self.server, PATH, config.max_speech_sessions, "--max-speech-sessions")
        if full is not None:
            await self._fail(full, CLOSE_BUSY)
            await self.out.stop()
            return
        inbox = IdleReceiver(self.ws, config.speech_idle_timeout_s, lambda: bool(self.running))
        try:
            await self._read_loop(inbox)
        except WebSocketDisconnect:
            pass
        finally:
            close_session(self.server, PATH)  # before the close: the client may reconnect
            await self._cancel_all()
            if self.served is not None:
                self.server.metrics.websocket_sessions.labels(self.served.name, PATH).dec()
            await self.out.stop()

    async def _read_loop(self, inbox: IdleReceiver) -> None:
        """Client messages until the socket closes (after `session.done`, an error, or the
        client's going away), a message is wrong, or the session has been idle too long (no
        message, no segment being spoken)."""
        while True:
            message = await inbox.receive()
            if message is None:
                idle_s = self.server.config.speech_idle_timeout_s
                expired = bad_request(f"the session was idle for {idle_s:g} s "
                                      "(--speech-idle-timeout): closed", param="type",
                                      code="session_expired")  # fmt: skip
                await self._fail(expired, 1000)
                return
            if message["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(message.get("code", 1000))
            try:
                await self._handle(message)
            except APIError as err:
                await self._fail(err, CLOSE_BAD_REQUEST)
                return

    def send(self, message: dict) -> None:
        self.out.json(message)

    # --- messages -----------------------------------------------------------------------------
    async def _handle(self, message: dict) -> None:
        """One client message."""
        body = client_message(message, MAX_MESSAGE_CHARS)
        kind = body.pop("type")
        if kind == "session.start":
            await self._start(body)
            return
        if self.served is None:
            raise bad_request(f"'{kind}' before session.start", param="type")
        if self.ended and kind != "cancel":
            raise bad_request(f"'{kind}' after input.done", param="type")
        if kind == "input.text":
            text = body.get("text")
            if not isinstance(text, str) or set(body) != {"text"}:
                raise bad_request("input.text takes one field, 'text' (a string)", param="text")
            held = sum(len(s.text) for s in self.running) + len(self.segmenter.text)
            if held + len(text) > MAX_BUFFER_CHARS:
                raise bad_request(
                    f"'text': {held} characters wait to be spoken and this message brings "
                    f"{len(text)}; a session holds at most {MAX_BUFFER_CHARS} (send more as "
                    "segment.done messages come)",
                    param="text",
                    code="too_much_text",
                )
            self._speak_all(self.segmenter.add(text))
        elif kind in ("input.flush", "input.done"):
            if body:
                raise bad_request(f"{kind} takes no fields", param=next(iter(body)))
            if (rest := self.segmenter.flush()) is not None:
                self._speak_all([rest])
            if kind == "input.done":
                self.ended = True
                self.segments.put_nowait(None)  # the speaker ends the session after the rest
        elif kind == "cancel":
            cancelled = await self._cancel_all()
            self.segmenter.flush()
            self.ended = False
            self.speaker = asyncio.ensure_future(self._speak_loop())
            self.send({"type": "cancelled", "segments": cancelled})
        else:
            raise bad_request(
                f"unknown message type {kind!r}; the client sends session.start, input.text, "
                "input.flush, input.done and cancel",
                param="type",
            )

    async def _start(self, body: dict) -> None:
        if self.served is not None:
            raise bad_request("session.start was sent already", param="type")
        for name in ("input", "stream"):
            if name in body:
                raise bad_request(
                    f"'{name}': a WebSocket session takes its text as input.text messages",
                    param=name,
                )
        if "stream_format" in body:
            raise bad_request(
                "'stream_format': a WebSocket session sends its audio as binary messages",
                param="stream_format",
            )
        served = self.server.route(body.get("model"), "speech")
        self.format = speech.check_format(
            body.pop("response_format", None) or "pcm", False, STREAM_FORMATS
        )
        # The session's fields, checked (and the voice resolved, a reference encoded) once.
        job = await speech.parse(self.server, served, {**body, "input": "."})
        self.server.admit(served, dict(job.inputs), job.params, job.outputs)
        self.served, self.job = served, job
        self.server.metrics.websocket_sessions.labels(served.name, PATH).inc()
        self.speaker = asyncio.ensure_future(self._speak_loop())
        rate = _rate(served)
        self.send(
            {
                "type": "session.started",
                "model": served.name,
                "format": self.format,
                "sample_rate": rate,
                "sample_format": "s16le",
                "channels": 1,
            }
        )

    # --- segments -----------------------------------------------------------------------------
    def _speak_all(self, texts: list[str]) -> None:
        """Queue segments to be spoken; a 400 if that makes more wait than a session holds
        (a text of many tiny sentences: each is a request to the pipeline)."""
        if len(self.running) + len(texts) > MAX_SEGMENTS:
            raise bad_request(
                f"'text': {len(self.running)} segments wait to be spoken and this message "
                f"completes {len(texts)}; a session holds at most {MAX_SEGMENTS} (send more "
                "as segment.done messages come)",
                param="text",
                code="too_much_text",
            )
        for text in texts:
            self._speak(text)

    def _speak(self, text: str) -> None:
        segment = Segment(self.count, text)
        self.count += 1
        segment.task = asyncio.ensure_future(self._synthesise(segment))
        self.running.add(segment)
        self.segments.put_nowait(segment)

    async def _synthesise(self, segment: Segment) -> None:
        """Run one segment through the pipeline (up to AHEAD at once, in order), its audio
        into the segment's queue, then its end (or its error)."""
        served, job = self.served, self.job
        began = time.perf_counter()
        run, slot, status = None, None, 200
        try:
            async with self.ahead:
                inputs = {**job.inputs, served.speech_input.name: segment.text}
                admitted = self.server.admit(served, inputs, job.params, job.outputs)
                slot = await served.acquire()  # queued like any request while it is full
                request_id = chat.new_id().replace("chatcmpl", f"speech-ws{segment.index}")
                run = segment.run = Run(served, admitted, request_id, job.outputs, began)
                async for _, value in run.chunks():
                    segment.queue.put_nowait(value)
            segment.queue.put_nowait(_END)
        except APIError as err:
            status = err.status
            segment.queue.put_nowait(err)
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            await end_run(self.server, PATH, served, run, slot, status, began)

    async def _speak_loop(self) -> None:
        """Each segment's audio, in order, as it arrives; after the last, the session's end."""
        rate = _rate(self.served)
        while (segment := await self.segments.get()) is not None:
            self.send({"type": "segment.started", "segment": segment.index, "text": segment.text})
            tempo = Tempo(self.job.speed, rate) if self.job.speed is not None else None
            samples, ended = 0, False
            while not ended:
                item = await segment.queue.get()
                if isinstance(item, APIError):
                    self.running.discard(segment)
                    code = CLOSE_BAD_REQUEST if item.status < 500 else CLOSE_FAILED
                    await self._fail(item, code, segment.index)
                    return
                ended = item is _END
                if tempo is not None:
                    item = tempo.close() if ended else tempo.feed(item)
                elif ended:
                    break
                data = audio_bytes(item, rate, "pcm")
                if not data:
                    continue
                samples += len(data) // 2
                if self.format == "wav" and not self.header_sent:
                    data = streaming_wav_header(rate) + data
                    self.header_sent = True
                self.out.bytes(data)
            self.running.discard(segment)
            seconds = samples / rate
            self.audio_seconds += seconds
            done = {"type": "segment.done", "segment": segment.index, "audio_seconds": seconds}
            if segment.run is not None:
                done["seed"] = segment.run.seed
            self.send(done)
        self._finish()

    async def _cancel_all(self) -> list[int]:
        """Stop every segment (in every stage) and the speaker; the segments stopped."""
        stopped = sorted(s.index for s in self.running)
        tasks = [s.task for s in self.running if s.task is not None]
        if self.speaker is not None:
            tasks.append(self.speaker)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.running.clear()
        self.segments = asyncio.Queue()
        self.speaker = None
        return stopped

    def _finish(self) -> None:
        self.send(
            {
                "type": "session.done",
                "segments": self.count,
                "audio_seconds": round(self.audio_seconds, 6),
            }
        )
        self.out.close(1000, "done")

    async def _fail(self, err: APIError, code: int, segment: int | None = None) -> None:
        message = {"type": "error", **json.loads(err.response().body)}
        if segment is not None:
            message["segment"] = segment
        self.send(message)
        self.out.close(code, err.message)
        await self.out.flush()


def _rate(served) -> int:
    rates = [o.attrs.get("rate") for o in served.plan.outputs if o.type == "audio"]
    return int(rates[0]) if rates and rates[0] else 24000
