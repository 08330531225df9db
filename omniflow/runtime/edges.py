"""Edge-side work common to every mode: chunking a producer's steps by the edge's schedule,
and applying the edge's fused map chain on the side the compiler chose."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from omniflow.adapters import ADAPTERS
from omniflow.kernels.pointwise import fused
from omniflow.plan import ChannelPlan, Plan
from omniflow.runtime.values import TEXT_TYPES, concat, steps

# send(request_id, chunk_index, value or None, end_of_stream)
Send = Callable[[str, int, object, bool], None]


def map_chain(channel: ChannelPlan) -> tuple:
    return (
        tuple((op["name"], tuple(op["args"])) for op in channel.pointwise["chain"])
        if channel.pointwise
        else ()
    )


def apply_maps(channel: ChannelPlan, value, side: str):
    """Run the edge's fused map chain on `value` if it belongs on `side` ("src" or "dst")."""
    if value is None or not channel.pointwise:
        return value
    runs_in = channel.src_executor if side == "src" else channel.dst_executor
    if channel.pointwise["runs_in"] != runs_in or (
        side == "dst" and channel.src_executor == runs_in
    ):
        return value
    return fused(value, map_chain(channel))


def load_adapter(channel: ChannelPlan, plan: Plan) -> Callable | None:
    """The edge's adapter: its implementation is a factory, called once with the StagePlan
    the edge leaves (None for a pipeline input), that returns the function applied to each
    chunk."""
    if channel.adapter is None:
        return None
    from omniflow.runtime.python_backend import import_function

    spec = ADAPTERS.get(channel.adapter)
    make = import_function(spec.impl if spec else channel.adapter)
    source = next((s for s in plan.stages if s.name == channel.src), None)
    return make(source)


@dataclass
class _Pending:
    parts: list = field(default_factory=list)
    steps: int = 0
    index: int = 0


class StreamWriter:
    """Accumulates each request's steps on one edge and sends chunks of the scheduled sizes
    (the whole stream at once for a whole-output edge); the last chunk carries end-of-stream."""

    def __init__(self, channel: ChannelPlan, send: Send, adapter: Callable | None = None):
        self.channel = channel
        self.send = send
        self.adapter = adapter
        self.pending: dict[str, _Pending] = {}

    def _target(self, index: int) -> int | None:
        schedule = self.channel.schedule
        return None if schedule is None else schedule[min(index, len(schedule) - 1)]

    def write(self, request_id: str, value) -> None:
        p = self.pending.setdefault(request_id, _Pending())
        typ = self.channel.type
        p.parts.append(value)
        p.steps += steps(typ, value)
        target = self._target(p.index)
        while target is not None and p.steps >= target:
            if typ in TEXT_TYPES:
                head, p.parts = concat(typ, p.parts[:target]), p.parts[target:]
            else:
                joined = concat(typ, p.parts)
                head, p.parts = joined[:target], [joined[target:]] if p.steps > target else []
            p.steps -= target
            self._send(request_id, p, head, False)
            target = self._target(p.index)

    def end(self, request_id: str) -> None:
        p = self.pending.pop(request_id, _Pending())
        value = concat(self.channel.type, p.parts) if p.parts else None
        self._send(request_id, p, value, True)

    def drop(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def _send(self, request_id: str, p: _Pending, value, end: bool) -> None:
        if value is not None and self.adapter is not None:
            value = self.adapter(value)
        self.send(request_id, p.index, apply_maps(self.channel, value, "src"), end)
        p.index += 1
