"""One edge's value path, shared by every program loop and the reference interpreter so they
cannot disagree: where values leave (`leaving`: the edge's adapter, then its fused map
chain if the compiler put it on the producer's side), how a producer's steps are cut into
the edge's scheduled chunks (`StreamWriter`), and where they arrive (`arriving`: the map
chain if it runs on the consumer's side). While a loop is profiled, each chunk's pass
through an adapter or map chain is recorded (`transformed`); an edge without either is the
`identity` and records nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from omniflow.errors import OmniflowError
from omniflow.kernels.pointwise import fused
from omniflow.plan import ChannelPlan, StagePlan
from omniflow.runtime import events
from omniflow.runtime.doorbells import Ending
from omniflow.runtime.events import Recorder
from omniflow.runtime.port_values import TEXT_TYPES, Ahead, concat, steps
from omniflow.runtime.slack import Playback, StepTimer, cut_short

# send(request_id, chunk_index, value or None, end_of_stream, the producer's Ending or None)
Send = Callable[[str, int, object, bool, Ending | None], None]
Transform = Callable[[object], object]


def identity(value):
    return value


def _maps(channel: ChannelPlan, program: str) -> Transform:
    """The edge's fused map chain if it runs in `program`, else nothing."""
    if not channel.pointwise or channel.pointwise.runs_in != program:
        return identity
    chain = tuple((name, tuple(args)) for name, args in channel.pointwise.ops)
    return lambda value: value if value is None else fused(value, chain)


def leaving(channel: ChannelPlan, source: StagePlan | None) -> Transform:
    """What happens to a value as it leaves its producer: the adapter, then the maps that
    run on the producer's side. `source` is the producing stage (None for an input)."""
    maps = _maps(channel, channel.src_executor)
    adapter = load_adapter(channel, source)
    if adapter is None:
        return maps
    return lambda value: value if value is None else maps(adapter(value))


def arriving(channel: ChannelPlan) -> Transform:
    """What happens to a value as it reaches its consumer: the maps, if they run there and
    not already where the value left (a fused edge)."""
    if channel.src_executor == channel.dst_executor:
        return identity
    return _maps(channel, channel.dst_executor)


def transformed(
    recorder: Recorder | None,
    transform: Transform,
    value,
    channel: str,
    request_id: str,
    index: int,
    how: int,
):
    """`transform(value)`; while profiling, its time recorded as an ADAPT event (`how`:
    events.ADAPTER or events.MAPS) unless there was nothing to do (no transform, or an end
    without a value)."""
    if recorder is None or transform is identity or value is None:
        return transform(value)
    began = time.monotonic_ns()
    value = transform(value)
    recorder.add(events.ADAPT, channel, request_id, began, time.monotonic_ns() - began, index, how)
    return value


def load_adapter(channel: ChannelPlan, source: StagePlan | None) -> Transform | None:
    """The edge's adapter: its implementation is a factory, called once with the StagePlan
    the edge leaves (None for a pipeline input), that returns the function applied to each
    chunk."""
    if channel.adapter is None:
        return None
    from omniflow.runtime.python_backend import import_function

    return import_function(channel.adapter_impl or channel.adapter)(source)


def chunk_end(schedule: list[int], done: int) -> int:
    """Where the chunk of `schedule` (the last size repeating) that holds step `done` ends:
    the grid a paced edge's writer and its carried-state vocoder both keep to."""
    edge, chunk = 0, 0
    while edge <= done:
        edge += schedule[min(chunk, len(schedule) - 1)]
        chunk += 1
    return edge


@dataclass
class _Pending:
    parts: list = field(default_factory=list)
    steps: int = 0
    index: int = 0
    ahead: int = 0  # chunks sent ahead of the stream's own (`Ahead`), off the schedule
    sent: int = 0  # steps sent
    playback: Playback | None = None  # on a paced edge: its listener's (slack.py)
    producer: StepTimer = field(default_factory=StepTimer)


class StreamWriter:
    """Accumulates each request's steps on one edge and sends chunks of the scheduled sizes
    (the whole stream at once for a whole-output edge), each through `leave`; the last
    chunk carries the end of the stream.

    A paced edge (`plays_s`: into a vocoder that carries its state) keeps its chunks on the
    schedule's grid while its stream is ahead of its listener, and sends what it has at
    once when waiting for the rest of a chunk would leave the listener without audio
    (slack.py); its next chunk still ends on the grid.

    Steps written `Ahead` of a stream's own (a voice clone's reference frames) go at once,
    in chunks no longer than the schedule's longest (what the edge's ring slots hold), and
    neither take a place on the schedule nor count as sent: the stream's first step is
    still the schedule's first chunk, as the consumer's grid expects. On a whole-output
    edge they are the stream's first steps.

    A writer that `merges` (its channel passes references within a process: no ring slot
    bounds a chunk) sends the chunks one write completes together as one, their steps
    joined: a prefill's hundreds of prompt rows on a per-token edge go out as one chunk,
    not one each (at c=32 omni chat's thinker handed its talker 6,400 one-row chunks, ~90
    us of the loop each, before its first talker step). It still ends on the schedule's
    grid, and its index counts the chunks it joins.
    """

    def __init__(
        self, channel: ChannelPlan, send: Send, leave: Transform = identity, merges: bool = False
    ):
        self.channel = channel
        self.send = send
        self.leave = leave
        self.merges = merges
        self.pending: dict[str, _Pending] = {}
        self.recorder: Recorder | None = None  # while its loop is profiled
        self.how = events.ADAPTER if channel.adapter else events.MAPS  # what `leave` runs

    def _target(self, index: int) -> int | None:
        schedule = self.channel.schedule
        return None if schedule is None else schedule[min(index, len(schedule) - 1)]

    def write(self, request_id: str, value) -> None:
        p = self.pending.setdefault(request_id, _Pending())
        if isinstance(value, Ahead):
            value = value.value
            if self.channel.schedule is not None:
                self._ahead(request_id, p, value)
                return
        p.parts.append(value)
        added = steps(self.channel.type, value)
        p.steps += added
        if self.channel.plays_s is not None and self.channel.schedule is not None:
            self._paced(request_id, p, added)
            return
        due, chunks = 0, 0  # the steps and chunks this write completes, while merging
        target = self._target(p.index - p.ahead)
        while target is not None and p.steps - due >= target:
            if self.merges:
                due, chunks = due + target, chunks + 1
            else:
                self._send(request_id, p, self._cut(p, target), False)
            target = self._target(p.index + chunks - p.ahead)
        if chunks:
            self._send(request_id, p, self._cut(p, due), False, chunks=chunks)

    def _ahead(self, request_id: str, p: _Pending, value) -> None:
        """Send steps ahead of the stream's own (see the class docstring)."""
        if p.sent or p.steps:
            raise OmniflowError(
                f"steps sent ahead on edge {self.channel.name} after the stream's own began"
            )
        longest = max(self.channel.schedule)
        typ = self.channel.type
        pieces = [value] if typ in TEXT_TYPES else value.split(longest)
        for piece in pieces:
            self._send(request_id, p, piece, False)
            p.ahead += 1

    def _paced(self, request_id: str, p: _Pending, added: int) -> None:
        """Send a paced edge's chunks: those the grid completes, then what is pending if
        the listener would run dry waiting for the rest of its chunk."""
        now = time.monotonic()
        p.producer.add(added, now)
        if p.playback is None:
            p.playback = Playback(now)
        while p.steps:
            target = chunk_end(self.channel.schedule, p.sent) - p.sent
            if p.steps < target:
                started = p.playback.first_sent is not None  # a first chunk is never cut
                slack = p.playback.runs_out(self.channel.plays_s) - now
                if not started or not cut_short(slack, target - p.steps, p.producer.step_s):
                    return
                target = p.steps
            p.playback.send(target, now)
            self._send(request_id, p, self._cut(p, target), False)

    def _cut(self, p: _Pending, n: int):
        """The first `n` pending steps, taken off the pending ones."""
        typ = self.channel.type
        if typ in TEXT_TYPES:
            head, p.parts = concat(typ, p.parts[:n]), p.parts[n:]
        else:
            joined = concat(typ, p.parts)
            head, p.parts = joined[:n], [joined[n:]] if p.steps > n else []
        p.steps -= n
        p.sent += n
        return head

    def end(self, request_id: str, ending: Ending | None = None) -> None:
        p = self.pending.pop(request_id, _Pending())
        value = concat(self.channel.type, p.parts) if p.parts else None
        self._send(request_id, p, value, True, ending)

    def drop(self, request_id: str | None = None) -> None:
        """Forget a request's pending steps (every request's, if None)."""
        if request_id is None:
            self.pending.clear()
        else:
            self.pending.pop(request_id, None)

    def _send(
        self,
        request_id: str,
        p: _Pending,
        value,
        end: bool,
        ending: Ending | None = None,
        chunks: int = 1,
    ) -> None:
        index = p.index
        p.index += chunks
        value = transformed(
            self.recorder, self.leave, value, self.channel.name, request_id, index, self.how
        )
        self.send(request_id, index, value, end, ending)
