"""A pipeline the server serves: its plan, its engine, what it answers, and admission.

What a pipeline answers follows from its ports (no per-pipeline code):

- chat (`/v1/chat/completions`): a `chat` input, and a text or audio output;
- speech (`/v1/audio/speech`): a text input and an audio output, and no chat input;
- images (`/v1/images/generations`): a text or chat prompt, an image output, and no
  image input it requires;
- edits (`/v1/images/edits`): an `image` input, a `prompt` input and an image output;
- videos (`/v1/videos`, jobs): a text or chat prompt and a video output (an `image` input
  makes it image-to-video).

Admission: each pipeline runs `limit` requests at once (by default its narrowest stage's
batch); beyond it requests wait in a bounded queue, first come first served, and start as
slots free up. Only a full queue (`max_queue`, by default 4 x `limit`), or a wait past
`max_wait_s`, answers 503 with `Retry-After`. A slot is held until the request's last byte
is sent or its client goes away, and released exactly once; a client that goes away while
queued leaves the queue.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from omniflow.ir.kinds import requests_at_once
from omniflow.plan import Plan, PortPlan
from omniflow.server.errors import busy
from omniflow.server.metrics import Metrics, PipelineStats

# Requests that may wait per admission slot, by default, and how long one may wait.
QUEUE_PER_SLOT = 4
DEFAULT_MAX_WAIT_S = 600.0

ENDPOINTS = {
    "chat": "/v1/chat/completions",
    "speech": "/v1/audio/speech",
    "images": "/v1/images/generations",
    "edits": "/v1/images/edits",
    "videos": "/v1/videos",
}


def capacity(plan: Plan) -> int:
    """How many requests a plan serves at once (`kinds.requests_at_once`)."""
    return requests_at_once((s.kind, s.settings.get("max_batch") or s.batch) for s in plan.stages)


@dataclass
class Served:
    name: str
    plan: Plan
    engine: object  # omniflow.runtime.engine.Engine (or a stand-in with the same methods)
    limit: int
    metrics: Metrics
    defaults: dict = field(default_factory=dict)  # parameter values `omniflow run --param` set
    # What admission checks its requests with beyond the plan (preflight's: speakers, the
    # model families' own checks).
    checks: tuple = ()
    max_queue: int | None = None  # requests that may wait for a slot (default 4 x limit)
    max_wait_s: float = DEFAULT_MAX_WAIT_S
    inflight: int = 0
    draining: bool = False

    def __post_init__(self):
        from omniflow.server.voices import voice_entry

        if self.max_queue is None:
            self.max_queue = QUEUE_PER_SLOT * self.limit
        self.waiting: deque[tuple[int, asyncio.Future]] = deque()  # (slots, granted), in order
        self.stats = PipelineStats()
        self.voice_entry = voice_entry(self)
        self.metrics.admission_limit.labels(self.name).set(self.limit)
        self.metrics.in_flight.labels(self.name).set(0)
        self.metrics.queued.labels(self.name).set(0)
        self.metrics.served[self.name] = self

    # --- ports ------------------------------------------------------------------------------
    def inputs_of(self, *types: str) -> list[PortPlan]:
        return [p for p in self.plan.inputs if p.type in types]

    def outputs_of(self, *types: str) -> list[PortPlan]:
        return [p for p in self.plan.outputs if p.type in types]

    def input_named(self, name: str, *types: str) -> PortPlan | None:
        return next((p for p in self.inputs_of(*types) if p.name == name), None)

    @property
    def chat_input(self) -> PortPlan | None:
        return next(iter(self.inputs_of("chat")), None)

    @property
    def prompt_input(self) -> PortPlan | None:
        """The prompt of an image pipeline: `prompt` if it has one, else its only required
        text or chat input."""
        named = self.input_named("prompt", "text", "chat")
        if named is not None:
            return named
        required = [p for p in self.inputs_of("text", "chat") if p.default is None]
        return required[0] if len(required) == 1 else None

    @property
    def speech_input(self) -> PortPlan | None:
        """The text a speech pipeline speaks: `text` or `input`, else its only required text."""
        for name in ("text", "input"):
            if (port := self.input_named(name, "text")) is not None:
                return port
        required = [p for p in self.inputs_of("text") if p.default is None]
        return required[0] if len(required) == 1 else None

    @property
    def capabilities(self) -> list[str]:
        audio, text = self.outputs_of("audio"), self.outputs_of("text")
        images = self.outputs_of("image")
        found = []
        if self.chat_input and (audio or text):
            found.append("chat")
        if not self.chat_input and self.speech_input and audio:
            found.append("speech")
        required_images = [p for p in self.inputs_of("image") if p.default is None]
        if images and self.prompt_input and not required_images:
            found.append("images")
        if images and self.prompt_input and self.input_named("image", "image"):
            found.append("edits")
        if self.video_port is not None and self.prompt_input:
            found.append("videos")
        return found

    @property
    def speakers(self) -> list[str]:
        """The named speakers of its models (as preflight read them from the checkpoints)."""
        from omniflow.runtime.requests import Voice

        found = [s for c in self.checks if isinstance(c, Voice) for s in c.speakers]
        return list(dict.fromkeys(found))

    @property
    def video_port(self) -> PortPlan | None:
        return next(iter(self.outputs_of("video")), None)

    def describe(self) -> str:
        """What it serves, for error messages: its endpoints and outputs."""
        endpoints = ", ".join(ENDPOINTS[c] for c in self.capabilities) or "no endpoint"
        outputs = ", ".join(f"{o.name} ({o.type})" for o in self.plan.outputs)
        return f"pipeline '{self.name}' serves {endpoints}; its outputs: {outputs}"

    # --- admission --------------------------------------------------------------------------
    async def acquire(self, count: int = 1) -> Slot:
        """`count` admission slots: at once where free and nobody waits before this request,
        else once those queued before it have theirs and enough have freed; 503 (with
        Retry-After) when the queue is full or the wait passes `max_wait_s`. A caller
        checks `count` against `limit` first (as a 400 naming its field): more could never
        be granted, and would hold up the queue behind it until the wait's 503."""
        if not 1 <= count <= self.limit:
            raise ValueError(
                f"{count} slots asked of pipeline '{self.name}', which has {self.limit}"
            )
        if self.draining:
            raise busy("the server is shutting down and admits no new requests", retry_after=5)
        began = time.perf_counter()
        if not self.waiting and self.inflight + count <= self.limit:
            self._take(count)
        else:
            await self._queue(count)
        waited = time.perf_counter() - began
        self.metrics.queue_wait.labels(self.name).observe(waited)
        return Slot(self, count, waited)

    async def _queue(self, count: int) -> None:
        if len(self.waiting) >= self.max_queue:
            raise busy(
                f"pipeline '{self.name}' runs {self.inflight} request(s) (its limit) and "
                f"{len(self.waiting)} wait, as many as its queue holds; retry shortly"
            )
        entry = (count, asyncio.get_running_loop().create_future())
        self.waiting.append(entry)
        self._count_queue()
        try:
            await asyncio.wait_for(asyncio.shield(entry[1]), self.max_wait_s)
        except (TimeoutError, asyncio.CancelledError) as err:
            if entry[1].done():  # granted as the wait ended: give the slots back
                self.release(count)
            else:
                self.waiting.remove(entry)
                entry[1].cancel()
                self._count_queue()
            if isinstance(err, TimeoutError):
                raise busy(
                    f"pipeline '{self.name}' has had no free slot for {self.max_wait_s:g} s; "
                    "retry shortly"
                ) from None
            raise

    def _take(self, count: int) -> None:
        self.inflight += count
        self.metrics.in_flight.labels(self.name).set(self.inflight)

    def release(self, count: int) -> None:
        """Slots given back: the longest-waiting requests take them, in order."""
        self.inflight -= count
        while self.waiting and self.inflight + self.waiting[0][0] <= self.limit:
            wanted, granted = self.waiting.popleft()
            self.inflight += wanted
            granted.set_result(None)
        self.metrics.in_flight.labels(self.name).set(self.inflight)
        self._count_queue()

    def _count_queue(self) -> None:
        self.metrics.queued.labels(self.name).set(len(self.waiting))


class Slot:
    """Admission slots held by one HTTP request (`waited`: seconds it queued for them);
    `release()` is idempotent."""

    def __init__(self, served: Served, count: int, waited: float = 0.0):
        self.served = served
        self.count = count
        self.waited = waited

    def release(self) -> None:
        if self.count:
            count, self.count = self.count, 0
            self.served.release(count)
