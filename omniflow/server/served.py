"""A pipeline the server serves: its plan, its engine, what it answers, and admission.

What a pipeline answers follows from its ports (no per-pipeline code):

- chat (`/v1/chat/completions`): a `chat` input, and a text or audio output;
- speech (`/v1/audio/speech`): a text input and an audio output, and no chat input;
- images (`/v1/images/generations`): a text or chat prompt, an image output, and no
  image input it requires;
- edits (`/v1/images/edits`): an `image` input, a `prompt` input and an image output;
- videos (`/v1/videos`, jobs): a text or chat prompt and a video output (an `image` input
  makes it image-to-video).

Admission: each pipeline admits `limit` requests at once (by default its narrowest
stage's batch: more would only wait in a queue); beyond it the server answers 503 with
`Retry-After` at once. A slot is held until the request's last byte is sent or its
client goes away, and released exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omniflow.plan import Plan, PortPlan
from omniflow.server.errors import busy
from omniflow.server.metrics import Metrics, PipelineStats

ENDPOINTS = {
    "chat": "/v1/chat/completions",
    "speech": "/v1/audio/speech",
    "images": "/v1/images/generations",
    "edits": "/v1/images/edits",
    "videos": "/v1/videos",
}


def capacity(plan: Plan) -> int:
    """How many requests a plan serves at once: its narrowest stage's batch."""
    batches = [s.settings.get("max_batch") or s.batch for s in plan.stages]
    return max(1, min(batches, default=1))


@dataclass
class Served:
    name: str
    plan: Plan
    engine: object  # omniflow.runtime.engine.Engine (or a stand-in with the same methods)
    limit: int
    metrics: Metrics
    defaults: dict = field(default_factory=dict)  # parameter values `omniflow run --param` set
    inflight: int = 0
    draining: bool = False

    def __post_init__(self):
        self.stats = PipelineStats()
        self.metrics.admission_limit.labels(self.name).set(self.limit)
        self.metrics.in_flight.labels(self.name).set(0)
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
    def video_port(self) -> PortPlan | None:
        return next(iter(self.outputs_of("video")), None)

    def describe(self) -> str:
        """What it serves, for error messages: its endpoints and outputs."""
        endpoints = ", ".join(ENDPOINTS[c] for c in self.capabilities) or "no endpoint"
        outputs = ", ".join(f"{o.name} ({o.type})" for o in self.plan.outputs)
        return f"pipeline '{self.name}' serves {endpoints}; its outputs: {outputs}"

    # --- admission --------------------------------------------------------------------------
    def acquire(self, count: int = 1) -> Slot:
        """`count` admission slots, or 503 at once."""
        if self.draining:
            raise busy("the server is shutting down and admits no new requests", retry_after=5)
        if self.inflight + count > self.limit:
            raise busy(
                f"pipeline '{self.name}' has {self.inflight} request(s) in flight, its limit "
                f"is {self.limit}; retry shortly"
            )
        self.inflight += count
        self.metrics.in_flight.labels(self.name).set(self.inflight)
        return Slot(self, count)


class Slot:
    """Admission slots held by one HTTP request; `release()` is idempotent."""

    def __init__(self, served: Served, count: int):
        self.served = served
        self.count = count

    def release(self) -> None:
        if self.count:
            self.served.inflight -= self.count
            self.count = 0
            self.served.metrics.in_flight.labels(self.served.name).set(self.served.inflight)
