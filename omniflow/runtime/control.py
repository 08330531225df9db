"""The control plane's typed messages (msgspec, msgpack on the wire; never pickle).

Linking: each executor says `Started` once its process is up (what its start took), then
`Loaded` as each of its stages' models loads, and on a GPU
`Memory` once they all have (what torch reserved there beside what the plan gave its
stages), then creates shared-memory rings for the cross-process channels it
consumes and says `Hello` with their names; the engine tells every producer where to attach
(`Connect`), and each answers `Linked`. Serving: `Start` carries a request's parameters for
the stages of one executor, `Cancel` withdraws the request, `Failed` reports that a stage
failed it. A request that goes well costs no control message after its `Start`, and the
`Start` does not wake the executor: it waits on a queue of its own that the executor reads
when the request's first chunk (or a `Cancel`) reaches it (engine.py, executor.py). After
an executor dies, `Reset` makes the survivors drop every request and re-create the rings
that the dead one fed, and linking runs again for its replacement.
"""

from __future__ import annotations

from bisect import bisect_left

import msgspec

from omniflow.devices import human_bytes

# The upper bounds of the always-on histograms' buckets (Prometheus `le`: a value lands in
# the first bucket whose bound is >= it; one more bucket counts the rest). `/metrics`
# exports them as they are (server/metrics.py). Times in ns, so the hot path bisects ints.
BATCH_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STEP_NS_BOUNDS = tuple(
    int(s * 1e9) for s in (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
)
HANDOFF_NS_BOUNDS = tuple(
    int(s * 1e9) for s in (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1)
)


def _buckets(bounds: tuple) -> list[int]:
    return [0] * (len(bounds) + 1)


class Hello(msgspec.Struct, tag=True):
    executor: str
    rings: dict[str, str]  # channel name -> ring name this executor created (it consumes them)


class Loaded(msgspec.Struct, tag=True):
    """A stage's model is loaded (sent while the executor starts, before its Hello)."""

    stage: str
    seconds: float
    captured: float = 0.0  # of `seconds`, capturing CUDA graphs
    graphs: int = 0  # the CUDA graphs captured
    capture_work: str = ""  # what capturing them ran (`Backend.capture_work`)
    alongside: float = 0.0  # of `seconds`, while another stage of its executor loaded too

    def lines(self, where: str) -> list[str]:
        """What a person watching `where` (`pipeline/stage`) load is told: the load's time,
        how much of it ran beside the executor's other loads, and the CUDA-graph capture's,
        which can be most of it."""
        told = [f"loaded {where} in {self.seconds:.1f} s"]
        if self.alongside:
            told[0] += f" ({self.alongside:.1f} s of it beside its executor's other stages)"
        if self.graphs:
            told.append(f"{where}: captured {self.graphs} CUDA graphs in {self.captured:.1f} s")
            if self.capture_work:
                told.append(f"{where}: capture ran {self.capture_work}")
        return told

    @property
    def about(self) -> str:
        """Whom its lines are about: the stage."""
        return self.stage


class Memory(msgspec.Struct, tag=True):
    """What an executor process's GPU holds once its stages loaded (sent after their
    `Loaded`, before its `Hello`; only where the GPU is): the bytes torch's allocator
    reserved there (`torch.cuda.memory_reserved`: its stages' weights, caches, captured
    graphs' pools, and what the allocator keeps cached) beside `planned`, its stages'
    budgets on that GPU, and the GPU's bytes in use (`torch.cuda.mem_get_info`): every
    process's, CUDA contexts included, which no budget holds. `allocated`: the reserved
    bytes in tensors; the rest is cached, among it what a stage's load freed in its own pool
    (budgets.load_in_own_pool), which no other stage reuses."""

    executor: str
    device: str
    planned: int
    reserved: int
    allocated: int
    used: int

    @property
    def about(self) -> str:
        """Whom its lines are about: the executor."""
        return self.executor

    def lines(self, where: str) -> list[str]:
        """What a person watching `where` (`pipeline/executor`) start is told."""
        return [
            f"{where} on {self.device}: torch reserved {human_bytes(self.reserved)} "
            f"({human_bytes(self.allocated)} in tensors) of the "
            f"{human_bytes(self.planned)} planned for its stages; the GPU has "
            f"{human_bytes(self.used)} in use (every process, CUDA contexts included)"
        ]


class Started(msgspec.Struct, tag=True):
    """An executor process is up, before its stages load: how long its Python took to start
    and import the executor (from the engine's spawn; None where the engine's clock is
    another machine's) and to create its CUDA contexts (0 without a GPU)."""

    executor: str
    python: float | None
    cuda: float

    @property
    def about(self) -> str:
        """Whom its lines are about: the executor."""
        return self.executor

    def lines(self, where: str) -> list[str]:
        """What a person watching `where` (`pipeline/executor`) start is told."""
        parts = [] if self.python is None else [f"Python and imports {self.python:.1f} s"]
        parts += [f"CUDA context {self.cuda:.1f} s"] if self.cuda else []
        return [f"{where} started: {', '.join(parts)}"] if parts else []


# What an executor says while it starts, each with its `lines` for a person watching.
StartupReport = Started | Loaded | Memory


class Connect(msgspec.Struct, tag=True):
    rings: dict[str, str]  # channel name -> ring name to attach to as producer


class Linked(msgspec.Struct, tag=True):
    executor: str


class Start(msgspec.Struct, tag=True):
    request_id: str
    params: dict[str, dict]  # stage -> its resolved parameters


class Cancel(msgspec.Struct, tag=True):
    request_id: str


class Reset(msgspec.Struct, tag=True):
    peers: list[str]  # the executors that died


class Shutdown(msgspec.Struct, tag=True):
    pass


class Failed(msgspec.Struct, tag=True):
    request_id: str
    stage: str
    error: str


class Inspect(msgspec.Struct, tag=True):
    pass


class RequestStats(msgspec.Struct, tag=True):
    """One request's per-stage and per-channel tables from one executor (tallies.py)."""

    request_id: str
    stages: dict[str, dict[str, float]]
    edges: dict[str, dict[str, float]]


class Profile(msgspec.Struct, tag=True):
    """Start recording events (`capacity` per executor; with `gpu`, the torch profiler's
    kernel timeline too where the executor's stages run on CUDA; only `stages` and the
    requests whose ids start with one of `requests`, where given), or stop. Either way the
    executor answers `Profiled`: empty when starting (it records from then on)."""

    on: bool
    capacity: int = 1 << 16
    gpu: bool = False
    stages: list[str] | None = None
    requests: list[str] = []


class Profiled(msgspec.Struct, tag=True):
    """An executor's recorded events (events.py): names, request ids, packed int64 rows;
    `kernels`: its GPU timeline (gpu_timeline.py), on the same clock, and `streams`: the
    stage each CUDA stream of it runs."""

    executor: str
    names: list[str] = []
    requests: list[str] = []
    rows: bytes = b""
    dropped: int = 0
    # name, start ns, duration ns, device, stream; and which stage's each stream is
    kernels: list[tuple[str, int, int, int, int]] = []
    streams: list[tuple[int, str]] = []


class StageTotals(msgspec.Struct, array_like=True):
    """A stage's counters since its executor started: steps, their time, and the calls they
    advanced (calls / steps is the mean batch size); steps counted by batch size and by
    time (buckets of BATCH_BOUNDS and STEP_NS_BOUNDS)."""

    steps: int = 0
    step_ns: int = 0
    calls: int = 0
    batches: list[int] = msgspec.field(default_factory=lambda: _buckets(BATCH_BOUNDS))
    times: list[int] = msgspec.field(default_factory=lambda: _buckets(STEP_NS_BOUNDS))
    # What its backend counted (`Call.counters`: a denoiser's steps computed and reused).
    counters: dict[str, int] = msgspec.field(default_factory=dict)

    def count(self, counters: dict[str, int]) -> None:
        for key, value in counters.items():
            self.counters[key] = self.counters.get(key, 0) + value

    def add(self, batch: int, took_ns: int) -> None:
        """One step of `batch` calls that took `took_ns` (fixed arrays: nothing grows)."""
        self.steps += 1
        self.step_ns += took_ns
        self.calls += batch
        self.batches[bisect_left(BATCH_BOUNDS, batch)] += 1
        self.times[bisect_left(STEP_NS_BOUNDS, took_ns)] += 1


class ChannelTotals(msgspec.Struct, array_like=True):
    """An outbound channel's counters since its executor started, and what waits now:
    chunks put, their bytes and the time putting them took; chunks queued for credits."""

    chunks: int = 0
    bytes: int = 0
    put_ns: int = 0
    queued: int = 0


class HandoffTotals(msgspec.Struct, array_like=True):
    """An inbound channel's hand-offs since its executor started (its consumer's side):
    chunks counted by the time from their put to their take (buckets of HANDOFF_NS_BOUNDS),
    and that time summed."""

    times: list[int] = msgspec.field(default_factory=lambda: _buckets(HANDOFF_NS_BOUNDS))
    ns: int = 0

    def add(self, took_ns: int) -> None:
        self.ns += took_ns
        self.times[bisect_left(HANDOFF_NS_BOUNDS, took_ns)] += 1


class Inspection(msgspec.Struct, tag=True):
    """An executor's live state: requests each stage holds, ring slots it has not released,
    chunks waiting in its outboxes for credits, and its stages' and outbound channels'
    counters; `held`: the slots its stages hold per inbound channel (counted when
    inspected); `handoffs`: its inbound channels' hand-off times (a channel's two ends live
    in two executors, hence a table of their own)."""

    executor: str
    calls: dict[str, list[str]]
    held_slots: int
    queued_chunks: int
    stages: dict[str, StageTotals] = {}
    channels: dict[str, ChannelTotals] = {}
    held: dict[str, int] = {}
    handoffs: dict[str, HandoffTotals] = {}
    # stage -> request -> (done, total) steps, for calls whose backend says (`progress`).
    progress: dict[str, dict[str, list[int]]] = {}
    # Objects its process froze out of the garbage collector's walks (heap.py; 0: none).
    heap_frozen: int = 0


Message = (
    Hello
    | Started
    | Loaded
    | Memory
    | Connect
    | Linked
    | Start
    | Cancel
    | Reset
    | Shutdown
    | Failed
    | Inspect
    | Inspection
    | Profile
    | Profiled
    | RequestStats
)

# The start queue is a Unix socket of whole messages (SOCK_SEQPACKET); a Start bigger than
# this (a parameter that holds a large input) goes over zmq instead, as does one that finds
# the queue full.
QUEUED_START_MAX_BYTES = 64 * 1024

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)
