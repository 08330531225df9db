"""What a program loop records while it is profiled: stage steps, each request's share of
them, chunks handed to and taken from channels, and the loop's sleeps.

A `Recorder` is one pre-allocated buffer of int64 fields (a ring of `capacity` events: the
oldest are overwritten), so recording an event stores seven integers and allocates nothing
that grows. Times are `time.monotonic_ns()`, one clock for every process of a host, so the
events of all executors merge into one timeline. Names (stages, channels) and request ids
are interned once into small tables. A loop that is not profiled has no recorder and pays
one `is None` test per site.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

FIELDS = 7  # t, dur, kind, what, request, n, m

# Event kinds and what their fields mean.
STEP = 1  # a stage's step: what=stage, n=batch size, dur=its time
CALL = 2  # one request's share of a step: what=stage, n=steps it emitted, m=1 if it ended
SEND = 3  # a chunk onto a channel: what=channel, n=bytes, m=chunk index, dur=time to put
RECV = 4  # a chunk taken from a channel: what=channel, n=bytes, m=chunk index
WAIT = 5  # the loop slept: dur=how long
START = 6  # a request's parameters reached the loop: what=stage
KIND_NAMES = {STEP: "step", CALL: "call", SEND: "send", RECV: "recv", WAIT: "wait", START: "start"}
NO_REQUEST = -1


class Recorder:
    def __init__(self, names: list[str], capacity: int = 1 << 16):
        self.names = list(names)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.capacity = capacity
        self.buffer = array.array("q", bytes(8 * FIELDS * capacity))
        self.count = 0
        self.requests: list[str] = []
        self.request_index: dict[str, int] = {}

    def request(self, request_id: str) -> int:
        index = self.request_index.get(request_id)
        if index is None:
            index = self.request_index[request_id] = len(self.requests)
            self.requests.append(request_id)
        return index

    def add(
        self, kind: int, what: str | None, request: str | None, t: int, dur: int = 0, n=0, m=0
    ) -> None:
        base = (self.count % self.capacity) * FIELDS
        buffer = self.buffer
        buffer[base] = t
        buffer[base + 1] = dur
        buffer[base + 2] = kind
        buffer[base + 3] = -1 if what is None else self.index[what]
        buffer[base + 4] = NO_REQUEST if request is None else self.request(request)
        buffer[base + 5] = n
        buffer[base + 6] = m
        self.count += 1

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

    def events(self) -> list[tuple[int, ...]]:
        values = array.array("q")
        values.frombytes(self.rows)
        return [tuple(values[i : i + FIELDS]) for i in range(0, len(values), FIELDS)]
