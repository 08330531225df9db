"""One admitted request running on its pipeline's engine, as an HTTP handler consumes it.

`Run.chunks()` yields `(output, value)` as the engine produces them, only for the outputs
the request asked for; once all of those have ended it stops (and so cancels what the
pipeline would still produce for outputs nobody reads). Text passes through the request's
stop strings, if any: the text is cut before the first, and the request ends there.
Closing the iterator early, or cancelling its task (a client that went away), cancels the
request in every stage (`engine.submit_stream`'s contract). It keeps the request's timeline
for the metrics and `--log-stats`: time to first token and first audio packet, end to end,
tokens, seconds of audio; and what the stage that made its text said when it ended it
(`Ending`: why, its prompt's and its generated tokens), which the reply's `finish_reason`
and `usage` report, and what came with the end of its audio (the talker's `Ending`, passed
on by the vocoder: the codec tokens it generated), which `usage` reports beside them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import torch

from omniflow.runtime.doorbells import Ending
from omniflow.runtime.engine import ChunkStream, RequestCancelled
from omniflow.runtime.requests import Admitted, RequestFailed
from omniflow.runtime.transport import EngineError
from omniflow.server.errors import APIError
from omniflow.server.playback import Playback

DEFAULT_RATE = 24000


@dataclass
class Timeline:
    began: float  # perf_counter when the HTTP request arrived
    first_text: float | None = None
    first_audio: float | None = None
    ended: float | None = None
    text_tokens: int = 0  # text chunks as they come; the stage's count once it ends
    audio_samples: int = 0
    rate: int = DEFAULT_RATE
    playback: Playback = field(default_factory=Playback)  # a listener from the first packet
    queued: float = 0.0  # seconds it waited in the admission queue for a slot

    def seconds(self, at: float | None) -> float | None:
        return None if at is None else at - self.began

    @property
    def audio_seconds(self) -> float:
        return self.audio_samples / self.rate if self.rate else 0.0


class StopScanner:
    """Text with the request's stop strings cut out: `feed` returns what may be sent now
    (holding back a tail that could be the start of a stop string) and whether a stop
    string was found; `flush` returns the tail at the end."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        scanned = len(self.pending)  # holds no stop string: only one ending in `text` is new
        self.pending += text
        starts = (max(0, scanned - len(s) + 1) for s in self.stops)
        hits = [i for i in map(self.pending.find, self.stops, starts) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        cut = max(0, len(self.pending) - self.hold)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class Run:
    served: object  # Served
    admitted: Admitted
    request_id: str
    outputs: set[str]  # the outputs the request asked for
    began: float
    stops: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.types = {o.name: o.type for o in self.served.plan.outputs}
        rates = [o.attrs.get("rate") for o in self.served.plan.outputs if o.type == "audio"]
        self.timeline = Timeline(
            self.began, rate=int(rates[0]) if rates and rates[0] else DEFAULT_RATE
        )
        self.ending: Ending | None = None  # the text's producing stage's, when it ended it
        self.audio_ending: Ending | None = None  # what came with the end of its audio
        self.stopped = False  # the server cut the text at one of `stops`
        self.error: APIError | None = None  # how a streamed reply ended, if not well
        self._stream: ChunkStream | None = None
        self._iterator: AsyncIterator | None = None
        self._first: asyncio.Future | None = None

    @property
    def seed(self) -> int:
        return self.admitted.seed

    @property
    def finish_reason(self) -> str:
        """Why the text ended: "length" at the stage's token limit, else "stop" (an end or
        stop token or string, the server's cut, or a pipeline that says no more)."""
        return self.ending.reason if self.ending is not None and not self.stopped else "stop"

    @property
    def usage(self) -> dict:
        """The tokens the text's stage counted; where it said none (the server cut the text
        at a stop string and cancelled the request, or a stage that does not count), the
        text chunks that arrived. The prompt's media placeholders, where the stage counted
        them, are `prompt_tokens_details` (part of `prompt_tokens`, as OpenAI's are); the
        audio's codec tokens, where its end said how many, are
        `completion_tokens_details.audio_tokens` and no part of `completion_tokens`, which
        a peer's client reads as the text's tokens (docs/server.md, "Chat")."""
        prompt = self.ending.prompt_tokens if self.ending is not None else 0
        completion = self.timeline.text_tokens
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if self.ending is not None and self.ending.media:
            media = self.ending.media
            usage["prompt_tokens_details"] = {f"{kind}_tokens": n for kind, n in media.items()}
        if self.audio_ending is not None:
            usage["completion_tokens_details"] = {"audio_tokens": self.audio_ending.tokens}
        return usage

    def start(self) -> None:
        """Submit the request now, before the reply's headers are sent (its first chunk is
        fetched by a task of its own): the pipeline starts at once."""
        with contextlib.suppress(EngineError):  # (raised again, a 503, by the first fetch)
            self._stream = self._submit()
        self._iterator = self._chunks()
        self._first = asyncio.ensure_future(self._iterator.__anext__())

    async def chunks(self) -> AsyncIterator[tuple[str, object]]:
        """`(output, value)` pairs as the pipeline produces them (see the module doc)."""
        if self._first is None:
            self.start()
        try:
            try:
                yield await self._first
            except StopAsyncIteration:
                return
            async for item in self._iterator:
                yield item
        finally:
            await self.close()

    async def last(self, output: str, what: str):
        """The last value the pipeline produces on `output` (an image or a video, whole); a
        pipeline that produces none is the server's error (500, naming `what`)."""
        value = None
        async for name, chunk in self.chunks():
            if name == output:
                value = chunk
        if value is None:
            raise APIError(
                500, f"pipeline '{self.served.name}' produced no {what}", code="no_output"
            )
        return value

    async def close(self) -> None:
        """End the request if it is still running (idempotent)."""
        if self._first is not None and not self._first.done():
            self._first.cancel()
            await asyncio.gather(self._first, return_exceptions=True)
        if self._iterator is not None:
            await self._iterator.aclose()
        if self._stream is not None:  # (submitted, and its chunks perhaps never fetched)
            await self._stream.aclose()

    def _submit(self) -> ChunkStream:
        return self.served.engine.submit_stream(self.admitted, request_id=self.request_id)

    async def _chunks(self) -> AsyncIterator[tuple[str, object]]:
        scanner = StopScanner(self.stops)
        open_outputs = set(self.outputs)
        try:
            if self._stream is None:
                self._stream = self._submit()
            async with aclosing(self._stream) as chunks:
                async for chunk in chunks:
                    if chunk.end and chunk.ending is not None:
                        if self.types[chunk.output] == "text":
                            self.ending = chunk.ending
                        elif self.types[chunk.output] == "audio" and chunk.output in self.outputs:
                            self.audio_ending = chunk.ending
                    if chunk.output not in open_outputs:
                        continue
                    if chunk.value is not None:
                        value = chunk.value
                        if self.types[chunk.output] == "text":
                            self.timeline.text_tokens += 1
                            if self.timeline.first_text is None:
                                self.timeline.first_text = time.perf_counter()
                            value, self.stopped = scanner.feed(value)
                        elif self.types[chunk.output] == "audio":
                            now, samples = time.perf_counter(), _samples(value)
                            if self.timeline.first_audio is None:
                                self.timeline.first_audio = now
                            self.timeline.audio_samples += samples
                            self.timeline.playback.arrived(now, samples / self.timeline.rate)
                        # (an empty text is the stop scanner holding it back; comparing a
                        # tensor with "" would be a torch call a chunk)
                        if not isinstance(value, str) or value:
                            yield chunk.output, value
                        if self.stopped:
                            break
                    if chunk.end:
                        if self.types[chunk.output] == "text" and (tail := scanner.flush()):
                            yield chunk.output, tail
                        open_outputs.discard(chunk.output)
                        if not open_outputs:
                            break
        except RequestFailed as err:
            raise APIError(500, str(err), code="pipeline_failed") from None
        except RequestCancelled as err:
            raise APIError(503, str(err), code="cancelled") from None
        except EngineError as err:
            raise APIError(
                503, f"the pipeline is not running: {err}", code="engine_closed"
            ) from None
        finally:
            self.timeline.ended = time.perf_counter()
            if self.ending is not None:  # the stage's count, not the chunks it came in
                self.timeline.text_tokens = self.ending.tokens


def _samples(value) -> int:
    return int(value.numel()) if isinstance(value, torch.Tensor) else 0
