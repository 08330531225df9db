"""What a program loop records while it is profiled: stage steps, each request's share of
them, chunks handed to and taken from channels, chunks through edges' adapters and map
chains, the loop's sleeps, and (the frontend) each request's admission and queueing.

A `Recorder` is one pre-allocated buffer of int64 fields (a ring of `capacity` events: the
oldest are overwritten), so recording an event packs seven integers into it with one
`struct.pack_into` call (a third cheaper than seven item stores) and allocates nothing that
grows. Times are `time.monotonic_ns()`, one clock for every process of a host, so the
events of all executors merge into one timeline. Names (stages, channels) and request ids
are interned once into small tables. A loop that is not profiled has no recorder and pays
one `is None` test per site.

A profile may be narrowed (`engine.start_profile(stages=..., requests=...)`): the recorder
knows only the names it records (an event about another is dropped by the same table
look-up that interns it), and decides once per request id, when it first sees it, whether
it starts with one of the prefixes asked for.
"""

from __future__ import annotations

import array
import struct
from dataclasses import dataclass, field

FIELDS = 7  # t, dur, kind, what, request, n, m

# Event kinds and what their fields mean.
STEP = 1  # a stage's step: what=stage, n=batch size, dur=its time
CALL = 2  # one request's share of a step: what=stage, n=steps it emitted, m=1 if it ended
SEND = 3  # a chunk onto a channel: what=channel, n=bytes, m=chunk index, dur=time to put
RECV = 4  # a chunk taken from a channel: what=channel, n=bytes, m=chunk index
WAIT = 5  # the loop slept: dur=how long
START = 6  # a request's parameters reached the loop: what=stage
# A request at the frontend, recorded as its inputs begin to go out (their puts follow):
# t=its arrival at the engine, n=ns its admission check took (in the caller's thread),
# dur=until then (the rest: waiting for the I/O thread, and its Starts sent).
ADMIT = 7
ADAPT = 8  # a chunk through an edge's adapter or map chain: what=channel, n=chunk, m=ADAPTER/MAPS
# What a backend counted for a request in a step (`Call.counters`): what=stage, t=the step's
# start, n=the counter (its index in COUNTERS), m=its value.
COUNT = 9
KIND_NAMES = {
    STEP: "step",
    CALL: "call",
    SEND: "send",
    RECV: "recv",
    WAIT: "wait",
    START: "start",
    ADMIT: "admit",
    ADAPT: "adapt",
    COUNT: "count",
}
# The counters a profile records (others are left to --log-stats and the stage totals).
COUNTERS = ("steps_computed", "steps_reused")
ADAPTER, MAPS = 1, 2  # an ADAPT event's m: the adapter (then any maps of that side), maps only
NO_REQUEST = -1
SKIPPED = -2  # a request the profile does not record


class Recorder:
    """`names`: the stages and channels to record (events of others are dropped);
    `requests`: request id prefixes to record (empty: every request)."""

    def __init__(self, names: list[str], capacity: int = 1 << 16, requests: tuple[str, ...] = ()):
        self.names = list(names)
        self.index: dict[str | None, int] = {name: i for i, name in enumerate(self.names)}
        self.index[None] = -1  # an event about no stage or channel (the loop's sleeps)
        self.prefixes = tuple(requests)
        self.capacity = capacity
        self.buffer = array.array("q", [0]) * (FIELDS * capacity)
        self.pack = struct.Struct(f"{FIELDS}q").pack_into
        self.count = 0
        self.requests: list[str] = []
        self.request_index: dict[str, int] = {}

    def request(self, request_id: str) -> int:
        index = self.request_index.get(request_id)
        if index is None:
            if self.prefixes and not request_id.startswith(self.prefixes):
                index = SKIPPED
            else:
                index = len(self.requests)
                self.requests.append(request_id)
            self.request_index[request_id] = index
        return index

    def add(
        self, kind: int, what: str | None, request: str | None, t: int, dur: int = 0, n=0, m=0
    ) -> bool:
        """Record an event; False if the profile does not record its stage, channel or
        request."""
        if request is None:
            rid = NO_REQUEST
        else:
            rid = self.request_index.get(request)
            if rid is None:
                rid = self.request(request)
            if rid == SKIPPED:
                return False
        what_index = self.index.get(what)
        if what_index is None:
            return False
        count = self.count
        self.count = count + 1
        offset = (count % self.capacity) * 8 * FIELDS
        self.pack(self.buffer, offset, t, dur, kind, what_index, rid, n, m)
        return True

    def counted(self, stage: str, request: str, t: int, counters: dict[str, int]) -> None:
        """A call's counters of the step that began at `t` (`Call.counters`)."""
        for key, value in counters.items():
            if key in COUNTERS:
                self.add(COUNT, stage, request, t, 0, COUNTERS.index(key), value)

    def dump(self) -> RecordedEvents:
        """Every event still in the buffer, oldest first."""
        kept = min(self.count, self.capacity)
        start = (self.count - kept) % self.capacity
        rows = self.buffer[start * FIELDS :] + self.buffer[: start * FIELDS]
        return RecordedEvents(
            self.names, self.requests, rows[: kept * FIELDS].tobytes(), self.count - kept
        )


@dataclass
class RecordedEvents:
    """A recorder's events as they travel: names, request ids, the packed int64 rows."""

    names: list[str]
    requests: list[str]
    rows: bytes
    dropped: int = 0
    kernels: list[tuple[str, int, int, int, int]] = field(default_factory=list)  # gpu_timeline
    streams: list[tuple[int, str]] = field(default_factory=list)  # a kernel's stream, its stage

    def events(self) -> list[tuple[int, ...]]:
        values = array.array("q")
        values.frombytes(self.rows)
        return [tuple(values[i : i + FIELDS]) for i in range(0, len(values), FIELDS)]
