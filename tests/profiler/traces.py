"""Traces of the split pipeline (helpers.py: a and b fused in executor a+b, c on its own) made
without running it, so a test can replay any interleaving exactly: `Events` writes a profile
event by event, `simulate` runs a seeded model of the program loops (turns, shared batches,
chunk schedules, hand-off latencies, a busy machine's stalls, cancelled requests) and records
what they would. Both go through the real recorder (runtime/events.py) and trace.py, and can
record imperfectly: an executor that began recording late, a ring that overwrote its oldest
events."""

from __future__ import annotations

import functools
import math
import random
from collections import defaultdict, deque
from dataclasses import dataclass, field

from omniflow.compiler import compile_source
from omniflow.profiler.trace import chrome_trace
from omniflow.runtime import events as ev
from omniflow.runtime.control import Profiled
from omniflow.runtime.events import Recorder
from tests.profiler.helpers import SPLIT

X, BC, BZ, CY = "x.out->a.in", "b.out->c.in", "b.out->z.in", "c.out->y.in"
# What each program's recorder names (loop.py: its stages, then its channels).
NAMES = {"frontend": [X, BZ, CY], "a+b": ["a", "b", X, BC, BZ], "c": ["c", BC, CY]}
TOKEN_BYTES = 8


@functools.lru_cache(maxsize=1)
def split_plan():
    return compile_source(SPLIT, "split.omni")


class Events:
    """One profile written by hand; times in µs. `recording_from[program]`: it records
    nothing earlier (it began recording late); `capacity`: each recorder's ring (or, by
    program, those that differ)."""

    def __init__(self, capacity: int | dict = 1 << 16, recording_from: dict | None = None):
        sizes = capacity if isinstance(capacity, dict) else {}
        default = 1 << 16 if isinstance(capacity, dict) else capacity
        self.recorders = {p: Recorder(names, sizes.get(p, default)) for p, names in NAMES.items()}
        self.recording_from = recording_from or {}

    def _add(self, program: str, kind: int, what, rid, t: float, dur=0.0, n=0, m=0) -> None:
        if t >= self.recording_from.get(program, -math.inf):
            self.recorders[program].add(kind, what, rid, round(t * 1e3), round(dur * 1e3), n, m)

    def put(self, program, channel, rid, t, index, size=TOKEN_BYTES, dur=1.0) -> None:
        self._add(program, ev.SEND, channel, rid, t, dur, size, index)

    def take(self, program, channel, rid, t, index, size=TOKEN_BYTES) -> None:
        self._add(program, ev.RECV, channel, rid, t, 0, size, index)

    def step(self, program, stage, t, dur, *calls) -> None:
        """A step of `stage` from t for dur: calls are (request, emitted, ended)."""
        self._add(program, ev.STEP, stage, None, t, dur, len(calls))
        for rid, emitted, ended in calls:
            self._add(program, ev.CALL, stage, rid, t, dur, emitted, int(ended))

    def start(self, program, stage, rid, t) -> None:
        self._add(program, ev.START, stage, rid, t)

    def idle(self, program, t, dur) -> None:
        self._add(program, ev.WAIT, None, None, t, dur)

    def trace(self, plan: bool = True) -> dict:
        profiles = [Profiled(p, **vars(r.dump())) for p, r in self.recorders.items()]
        return chrome_trace(profiles, split_plan()) if plan else chrome_trace(profiles, "split")


@dataclass
class _Message:
    visible: float  # when the consumer's loop can see it
    rid: str
    index: int
    tokens: int
    end: bool


@dataclass
class _Program:
    name: str
    clock: float = 0.0
    idle_since: float | None = None  # sleeping since (None: awake)
    inbound: list[str] = field(default_factory=list)


@dataclass
class Simulated:
    events: Events
    finished: list[str]  # requests whose outputs all ended, in order
    cancelled: list[str]


def simulate(
    seed: int,
    requests: int = 8,
    concurrency: int = 4,
    tokens=lambda rng, i: rng.randint(1, 12),
    late: dict[str, float] | None = None,
    capacity: int | dict = 1 << 16,
    cancel: float = 0.0,
    stall: float = 0.1,
) -> Simulated:
    """The split pipeline's loops run on a model machine. Each program takes turns (receive
    what is visible, step its stages in order up to 4 ready requests each, put what they
    produced by the edges' chunk schedules) and sleeps until something reaches it; the
    frontend submits `requests` requests `concurrency` at a time and takes their outputs.
    Hand-offs take random times; with probability `stall` a turn is held up (a busy
    machine). A request is cancelled with probability `cancel`: its loops drop it, and the
    chunks still travelling are never taken. `late[program]`: µs after the first request
    before that program records anything; `capacity`: each recorder's ring."""
    rng = random.Random(seed)
    first_at = 100.0
    late = late or {}
    events = Events(capacity, {p: first_at + dt for p, dt in late.items()})
    programs = {
        "frontend": _Program("frontend", inbound=[BZ, CY]),
        "a+b": _Program("a+b", inbound=[X]),
        "c": _Program("c", inbound=[BC]),
    }
    consumer = {X: "a+b", BC: "c", BZ: "frontend", CY: "frontend"}
    rings: dict[str, deque[_Message]] = {name: deque() for name in consumer}
    schedule = {BC: 8, BZ: 2, CY: 1}
    writers: dict[tuple[str, str], list[int]] = {}  # (channel, rid) -> [pending tokens, index]
    sizes = [tokens(rng, i) for i in range(requests)]
    waiting = deque(f"r{i}" for i in range(requests))
    size_of = {f"r{i}": n for i, n in enumerate(sizes)}
    doomed = {rid for rid in size_of if rng.random() < cancel}
    dropped: set[str] = set()
    in_flight: set[str] = set()
    ended_outputs: dict[str, set[str]] = defaultdict(set)
    finished: list[str] = []
    # per stage: rid -> [queued tokens, end received, started]
    queues: dict[str, dict[str, list]] = {s: {} for s in ("a", "b", "c")}
    ended_at: dict[str, set[str]] = defaultdict(set)

    def hold(p: _Program, dt: float) -> None:
        p.clock += dt
        if rng.random() < stall:
            p.clock += rng.expovariate(1 / 400)

    def send(p: _Program, channel: str, rid: str, index: int, count: int, end: bool) -> None:
        took = rng.uniform(0.5, 4.0)
        events.put(p.name, channel, rid, p.clock, index, count * TOKEN_BYTES, took)
        hold(p, took)
        visible = p.clock + rng.expovariate(1 / 20)
        rings[channel].append(_Message(visible, rid, index, count, end))
        other = programs[consumer[channel]]
        if other.idle_since is not None:  # its doorbell wakes it
            wake = max(visible, other.idle_since)
            events.idle(other.name, other.idle_since, wake - other.idle_since)
            other.clock, other.idle_since = wake + rng.uniform(1, 30), None

    def write(p: _Program, channel: str, rid: str, count: int, end: bool) -> None:
        """StreamWriter: chunks of the edge's size, the last one carrying the end."""
        pending = writers.setdefault((channel, rid), [0, 0])
        pending[0] += count
        size = schedule.get(channel)
        while size is not None and pending[0] >= size:
            pending[0] -= size
            send(p, channel, rid, pending[1], size, False)
            pending[1] += 1
        if end:
            send(p, channel, rid, pending[1], pending[0], True)
            del writers[channel, rid]

    def receive(p: _Program) -> list[tuple[str, _Message]]:
        got = []
        for channel in p.inbound:
            ring = rings[channel]
            keep = deque()
            while ring:
                m = ring.popleft()
                if m.visible > p.clock:
                    keep.append(m)
                elif m.rid in dropped:  # dropped with its request: never taken
                    continue
                else:
                    # A long chunk can arrive as several messages with the same index.
                    pieces = 1 if rng.random() < 0.8 else rng.randint(2, 3)
                    for k in range(pieces):
                        share = m.tokens // pieces + (k < m.tokens % pieces)
                        events.take(p.name, channel, m.rid, p.clock, m.index, share * TOKEN_BYTES)
                        hold(p, rng.uniform(0.1, 1.0))
                    got.append((channel, m))
            rings[channel] = keep
        return got

    def step(p: _Program, stage: str, produce) -> bool:
        ready = [
            r for r, q in queues[stage].items() if q[0] > 0 or (q[1] and r not in ended_at[stage])
        ]
        ready = [r for r in ready if r not in dropped][:4]
        if not ready:
            return False
        began, dur = p.clock, rng.uniform(5, 40) + 4 * len(ready)
        results = []
        for rid in ready:
            emitted, ended = produce(queues[stage][rid])
            results.append((rid, emitted, ended))
        events.step(p.name, stage, began, dur, *results)
        hold(p, dur)
        for rid, emitted, ended in results:
            if ended:
                ended_at[stage].add(rid)
                del queues[stage][rid]
            yield_out[stage](p, rid, emitted, ended)
        return True

    def a_produce(q):  # identity, up to 3 tokens a call
        n = min(q[0], rng.randint(1, 3))
        q[0] -= n
        return n, q[1] and q[0] == 0

    def b_produce(q):  # one token a call
        n = min(q[0], 1)
        q[0] -= n
        return n, q[1] and q[0] == 0

    def c_produce(q):  # everything queued
        n, q[0] = q[0], 0
        return n, q[1]

    def a_out(p, rid, n, end):  # by reference to b, in the same turn
        q = queues["b"].setdefault(rid, [0, False])
        q[0] += n
        q[1] = q[1] or end

    def b_out(p, rid, n, end):
        write(p, BC, rid, n, end)
        write(p, BZ, rid, n, end)

    def c_out(p, rid, n, end):
        write(p, CY, rid, n, end)

    yield_out = {"a": a_out, "b": b_out, "c": c_out}
    programs["frontend"].clock = first_at
    for p in ("a+b", "c"):
        programs[p].clock, programs[p].idle_since = first_at, first_at

    for _turn in range(100_000):
        awake = [p for p in programs.values() if p.idle_since is None]
        if not awake:
            break
        p = min(awake, key=lambda p: (p.clock, p.name))
        did = False
        if p.name == "frontend":
            while waiting and len(in_flight) < concurrency:
                rid = waiting.popleft()
                in_flight.add(rid)
                send(p, X, rid, 0, size_of[rid], True)
                did = True
            for channel, m in receive(p):
                did = True
                if m.end:
                    ended_outputs[m.rid].add(channel)
                    if ended_outputs[m.rid] == {BZ, CY}:
                        in_flight.discard(m.rid)
                        finished.append(m.rid)
            for rid in sorted(in_flight):
                if rid in doomed and rid not in dropped and rng.random() < 0.3:
                    dropped.add(rid)  # cancelled: every loop drops it
                    in_flight.discard(rid)
            hold(p, rng.uniform(1, 10))
        else:
            for _channel, m in receive(p):
                did = True
                stages = ("a", "b") if p.name == "a+b" else ("c",)
                for s in stages:
                    if m.rid not in queues[s] and m.rid not in ended_at[s]:
                        queues[s][m.rid] = [0, False]
                        events.start(p.name, s, m.rid, p.clock)
                q = queues[stages[0]].get(m.rid)
                if q is not None:
                    q[0] += m.tokens
                    q[1] = q[1] or m.end
            for s in ("a", "b") if p.name == "a+b" else ("c",):
                did = step(p, s, {"a": a_produce, "b": b_produce, "c": c_produce}[s]) or did
            hold(p, rng.uniform(1, 10))
        if not did:
            # Asleep until something reaches it (the frontend also for its next request).
            pending = [m.visible for c in p.inbound for m in rings[c]]
            if p.name == "frontend" and not in_flight and not waiting and not pending:
                break
            if pending and min(pending) > p.clock:
                events.idle(p.name, p.clock, min(pending) - p.clock)
                p.clock = min(pending)
            elif not pending:
                p.idle_since = p.clock
    return Simulated(events, finished, sorted(dropped))
