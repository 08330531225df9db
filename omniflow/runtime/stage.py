"""What a stage sees of one request (`Call`) and what every backend implements (`Backend`).

The runtime feeds a Call's input streams as chunks arrive, asks the backend which calls are
`ready`, and hands it batches of up to `max_batch` ready calls to `step`. A step consumes
input, `emit`s output steps and eventually `finish`es the call. Backends never see
channels, rings or processes: the same backend runs under the reference interpreter, in
process, and in an executor process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field

from omniflow.plan import ChannelPlan, StagePlan
from omniflow.runtime.doorbells import Ending
from omniflow.runtime.port_values import Ahead, concat


@dataclass(frozen=True)
class PortSpec:
    """An output port's item: dtype and shape of one step, as the plan sized it."""

    type: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class StageSpec:
    """A stage as its backend sees it: the plan entry plus its ports' types and shapes."""

    plan: StagePlan
    inputs: dict[str, str]  # port -> type
    outputs: dict[str, PortSpec]
    contexts: dict[str, int]  # input port -> left context its edge declares
    schedules: dict[str, list[int] | None] = field(default_factory=dict)  # input port -> chunks
    # Output port -> seconds of audio a step plays for, where its edge knows (slack.py).
    plays: dict[str, float] = field(default_factory=dict)
    # Input port -> seconds of audio a step plays for, where its edge is paced (slack.py).
    paced: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_channels(cls, stage: StagePlan, channels: list[ChannelPlan]) -> StageSpec:
        ins = {c.dst_port: c.type for c in channels if c.dst == stage.name}
        outs = {
            c.src_port: PortSpec(c.type, c.item_dtype, tuple(c.item_shape))
            for c in channels
            if c.src == stage.name
        }
        into = [c for c in channels if c.dst == stage.name]
        contexts = {c.dst_port: c.context for c in into}
        plays = {c.src_port: c.plays_s for c in channels if c.src == stage.name and c.plays_s}
        paced = {c.dst_port: c.plays_s for c in into if c.plays_s}
        schedules = {c.dst_port: c.schedule for c in into}
        return cls(stage, ins, outs, contexts, schedules, plays, paced)


class Wait:
    """Yielded by a generator stage that needs more input on `port` before it can go on."""

    def __init__(self, port: str):
        self.port = port


@dataclass
class InputStream:
    """The chunks of one input port that have arrived and not been consumed yet.

    A chunk may be a view into a channel's shared memory: its `release` frees the slot. Taken
    chunks are released after the step that took them (`release_spent`), so backends must
    copy what they keep across steps.
    """

    type: str
    chunks: deque = field(default_factory=deque)
    releases: list = field(default_factory=list)
    spent: list = field(default_factory=list)
    ended: bool = False
    ending: Ending | None = None  # what the producer said with the end, if it said

    def push(self, value, end: bool, release=None, ending: Ending | None = None) -> None:
        if value is not None:
            self.chunks.append(value)
        if release is not None:
            self.releases.append(release)
        self.ended = self.ended or end
        self.ending = self.ending or ending

    def available(self) -> bool:
        return bool(self.chunks)

    def take(self):
        """Everything available as one chunk (None if nothing is)."""
        self.spent += self.releases
        self.releases = []
        if not self.chunks:
            return None
        value = concat(self.type, list(self.chunks))
        self.chunks.clear()
        return value

    def release_spent(self, everything: bool = False) -> None:
        for release in self.spent + (self.releases if everything else []):
            release()
        self.spent = []
        if everything:
            self.releases = []
            self.chunks.clear()


@dataclass
class Call:
    """One request at one stage: its parameters, input streams, outputs and private state."""

    request_id: str
    params: dict
    inputs: dict[str, InputStream]
    state: dict = field(default_factory=dict)
    emitted: list[tuple[str, object]] = field(default_factory=list)
    finished: bool = False
    ending: Ending | None = None
    error: BaseException | None = None
    # What a backend counts for this request in a step (a denoiser's `steps_computed` and
    # `steps_reused`): the runtime adds them to the request's stats and the stage's totals
    # after each step, then clears them.
    counters: dict[str, int] = field(default_factory=dict)

    def emit(self, port: str, value, ahead: bool = False) -> None:
        """Send `value` (one or more steps) downstream on `port`; with `ahead`, steps that go
        before the stream's own and are no part of it, at once, outside the edge's chunk
        schedule (`port_values.Ahead`: a voice clone's reference frames)."""
        self.emitted.append((port, Ahead(value) if ahead else value))

    def finish(self, ending: Ending | None = None) -> None:
        """This stage is done with the request: every output stream ends, telling the
        consumers why and what it cost (`ending`) if the stage says. A stage that says
        nothing (a vocoder, which counts no tokens) passes on what the one input whose
        producer said something said, so that a talker's count reaches the pipeline's audio
        output; with several such inputs it could not tell whose to pass, and says nothing."""
        said = [s.ending for s in self.inputs.values() if s.ending is not None]
        self.finished = True
        self.ending = ending if ending is not None or len(said) != 1 else said[0]

    def fail(self, error: BaseException) -> None:
        """This request failed here; the runtime reports it with the stage's name."""
        self.error = error

    @property
    def running(self) -> bool:
        """Neither finished nor failed here: what it has on its way is still wanted."""
        return not self.finished and self.error is None

    def inputs_ended(self) -> bool:
        return all(s.ended for s in self.inputs.values())

    def read(self, port: str):
        """`chunk = yield from call.read(port)`: the next available chunk, None at end of stream."""
        stream = self.inputs[port]
        while not stream.available() and not stream.ended:
            yield Wait(port)
        return stream.take()

    def read_all(self, port: str):
        """`value = yield from call.read_all(port)`: the whole stream once it has ended."""
        stream = self.inputs[port]
        while not stream.ended:
            yield Wait(port)
        return stream.take()


class Backend(ABC):
    """A stage implementation. Construct = load weights; one instance serves every request."""

    # The CUDA graphs captured at load, and the seconds of the load that took (a backend that
    # captures sets both), and what the capture ran, said in a line ("": nothing to say).
    captures = 0
    capture_seconds = 0.0
    capture_work = ""
    # Set by the loop before each turn's steps: some stage of the program has a first packet
    # on the device (`first_packet_in_flight`). A stage that makes audio then launches
    # nothing for the streams that can wait (slack.py), and says they are not `ready`.
    first_packets_first = False
    # Set by the loop before each turn's steps: the requests whose makers some stage of the
    # program holds (`makers_wait_for`). A stage that makes such a request's inputs (a
    # thinker, a talker) launches nothing for it and says it is not `ready`, where it would
    # launch nothing else (a step that runs for other rows costs no more with it).
    held_requests: frozenset[str] = frozenset()

    def __init__(self, spec: StageSpec, device: str):
        self.spec = spec
        self.device = device

    @abstractmethod
    def ready(self, call: Call) -> bool:
        """Whether a step would make progress on `call` now."""

    @abstractmethod
    def step(self, calls: list[Call]) -> None:
        """Advance each call by one step (one batched forward, where the backend batches)."""

    def in_flight(self) -> bool:
        """Whether device work the backend queued has results it has not taken yet (a step
        whose read-back may still be on its way): while it has, the loop keeps turning and
        asks `ready` again instead of sleeping. A backend never waits for the device in
        `step` -- that would stall every stage sharing its process -- it says here that a
        later step will take what lands."""
        return False

    def costs_nothing(self, call: Call) -> bool:
        """Whether stepping the ready `call` does no work (it only passes the request on: a
        voice encoder's request with no reference to encode). The runner steps such calls
        beside its `max_batch`, which bounds a step's work, so that a stage whose requests
        mostly pass it holds none of them back a turn; by default none."""
        return False

    def first_packet_in_flight(self) -> bool:
        """Whether a request's first packet is on the device here (a prefill's first token
        or frame, a vocoder's first window, queued and not emitted yet): while a stage of
        the program says so, the loop sets every stage's `first_packets_first`."""
        return False

    def makers_wait_for(self) -> set[str]:
        """The requests whose work on the device here their own makers' next steps wait for
        (a vocoder's window that its listener needs before the frames after it: slack.py);
        by default none."""
        return set()

    def urgent_first(self, calls: list[Call]) -> list[Call]:
        """The ready `calls` in the order they should be stepped when not all fit a step
        (the runner takes the first `max_batch`): by default as given, arrival order; a
        stage that makes audio puts the stream whose listener runs dry first first
        (slack.py)."""
        return calls

    def progress(self, call: Call) -> tuple[int, int] | None:
        """How far a call has come, (done, total) steps, where the backend knows (a
        denoiser: its denoising steps); None otherwise. Read between steps, for
        `engine.inspect()` (a video job's progress)."""
        return None

    def drop(self, call: Call) -> None:  # noqa: B027 (optional hook)
        """Forget per-request state (the call finished, failed or was cancelled)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release what loading took (devices, files)."""
