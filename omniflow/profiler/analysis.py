"""A Chrome trace (trace.py) read back into what the report shows: every request's timeline
(its calls at each stage, its chunks on each edge, when its outputs began and ended), per-stage
and per-edge statistics, and each request's critical path.

Everything here reads the trace file alone: the plan comes from `otherData["plan"]` when the
trace carries it; without it, stages are the tracks that stepped (or started a request),
channels are named `src.port->dst.port`, and a stage that no recorded channel feeds is taken
to be fed by reference from the stages of its executor that step each request before it
(`Profile.feeds`). The stages are listed in the order of the graph (upstream first), never in
the order events happened to be recorded. Times are microseconds on the trace's clock.

Nothing here assumes an interleaving, nor that every event was recorded: an executor may have
started recording after a request began (its first events are missing), a ring may have
overwritten its oldest events, a chunk may have been put and never taken (a cancelled request)
or taken as several messages (long text). Chunks are matched by (channel, request, chunk index);
the tables count the events themselves.

The critical path of a request to one of its output chunks is walked backwards from the
frontend's take of that chunk, with a cursor that only moves back in time and charges every
microsecond it passes to one component, so the path adds up to the request's latency by
construction. A chunk leads to the step that emitted it (the time between is the edge's
hand-off, but for the part of it the consumer's executor spent stepping, which is the
consumer's waiting); a step leads to whichever finished last before it began — the arrival of
its input from upstream (the path moves upstream) or the stage's own previous step of the
request (it stays) — and the gap between is the stage's waiting (for its turn in a batch, for
the other stages of its executor). The walk ends at the request's inputs: the time from the
first input put to the one the path reached is the input edge's waiting. Where the events end
before the inputs do, the rest of the time, back to the first input put, is charged to
"<stage> (unrecorded)": at a chunk whose put, or whose producer's step, is not in the trace
(its executor was not recording then, or its ring overwrote them: the stage is the producer;
for an input chunk it is "<input edge> (unrecorded)"), or at a step with no input recorded
before it in an executor that began recording after the request did. (Such a step in an
executor that was recording leaves the rest to "<stage> (waiting)".)
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

WAITING = " (waiting)"
UNRECORDED = " (unrecorded)"
# Times are whole nanoseconds converted to µs: one event that follows another can land a few
# ns before its end (durations are rounded, and clamped to 1 ns), so "before" allows this much.
SLACK = 0.005


@dataclass
class Step:
    ts: float
    dur: float
    batch: int
    calls: list[tuple[str, int, bool]]  # (request, emitted, ended)
    # What the backend counted over the step's calls (a denoiser's steps computed, reused),
    # and per request.
    counters: dict[str, int] = field(default_factory=dict)
    call_counters: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class ChunkTrip:
    """One chunk of one request on one channel: when it was put and first taken, and how
    many put and take events the trace has of it (a long text chunk is taken as several
    messages; an untaken chunk has none, a chunk put before recording began no put)."""

    channel: str
    request: str
    index: int
    put: float | None = None
    put_dur: float = 0.0
    take: float | None = None
    puts: int = 0
    takes: int = 0
    put_bytes: int = 0
    taken_bytes: int = 0
    put_durs: list[float] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        """Its size: what was put, or what was taken when the put is not in the trace."""
        return self.put_bytes if self.puts else self.taken_bytes


@dataclass
class ChannelInfo:
    name: str
    src: str
    dst: str
    kind: str = "shm"  # "local": references inside an executor, no events recorded
    plan: dict = field(default_factory=dict)


@dataclass
class Call:
    start: float
    end: float
    emitted: int
    ended: bool


@dataclass
class RequestTimeline:
    id: str
    t0: float  # its inputs went out (the frontend's first put)
    complete: bool
    calls: dict[str, list[Call]] = field(default_factory=dict)
    trips: dict[str, list[ChunkTrip]] = field(default_factory=dict)
    first_out: dict[str, float] = field(default_factory=dict)  # output -> first data chunk taken
    last_out: float | None = None
    ttfp: dict[str, float] = field(default_factory=dict)  # output -> µs from t0
    e2e: float | None = None
    path_ttfp: dict[str, float] = field(default_factory=dict)  # component -> µs
    path_e2e: dict[str, float] = field(default_factory=dict)
    route: list[str] = field(default_factory=list)  # stages on the E2E critical path, in order
    # stage -> what its backend counted for this request (a denoiser's steps computed, reused)
    counters: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class Profile:
    """A trace parsed: its plan (or None), stages, channels, steps, chunk trips."""

    pipeline: str
    plan: dict | None
    stages: list[str]  # upstream first
    stage_executor: dict[str, str]
    inputs: list[str]
    outputs: list[str]
    channels: dict[str, ChannelInfo]
    steps: dict[str, list[Step]]
    trips: dict[str, dict[tuple[str, int], ChunkTrip]]
    executors: list[str]
    window: tuple[float, float]
    dropped: dict[str, int]
    # stage -> the stages that hand it values by reference (local channels; inferred from
    # the steps when the trace has no plan)
    feeds: dict[str, list[str]] = field(default_factory=dict)
    # executor -> when its first recorded event began (it recorded nothing before)
    recorded_from: dict[str, float] = field(default_factory=dict)


def process_names(events: list[dict]) -> dict[int, str]:
    """Each process's name (pid -> its `process_name` metadata)."""
    return {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }


def tracks_named(events: list[dict]) -> dict[tuple[int, int], str]:
    """Each track's name ((pid, tid) -> its `thread_name` metadata)."""
    return {
        (e["pid"], e.get("tid")): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }


def parse_trace(trace: dict) -> Profile:
    other = trace.get("otherData", {})
    plan = other.get("plan")
    events = trace.get("traceEvents", [])
    processes = process_names(events)
    track_names = tracks_named(events)
    steps: dict[str, list[Step]] = defaultdict(list)
    trips: dict[str, dict[tuple[str, int], ChunkTrip]] = defaultdict(dict)
    stage_executor: dict[str, str] = {}
    started: dict[str, set[str]] = defaultdict(set)  # stage -> requests with a `start` instant
    recorded_from: dict[str, float] = {}
    lo, hi = math.inf, -math.inf
    for e in events:
        ph, name = e.get("ph"), e.get("name", "")
        if ph not in ("X", "i"):
            continue
        ts = float(e["ts"])
        executor = processes.get(e["pid"], str(e["pid"]))
        recorded_from[executor] = min(recorded_from.get(executor, math.inf), ts)
        if ph == "i":
            stage = track_names.get((e["pid"], e.get("tid")))
            if name.startswith("start ") and stage is not None:
                started[stage].add(name[len("start ") :])
                stage_executor.setdefault(stage, executor)
            continue
        dur = float(e.get("dur", 0.0))
        lo, hi = min(lo, ts), max(hi, ts + dur)
        if name.endswith(" step"):
            stage = name[: -len(" step")]
            stage_executor.setdefault(stage, executor)
            args = e.get("args", {})
            calls = [(c["request"], int(c["emitted"]), bool(c["ended"])) for c in args["calls"]]
            counters: dict[str, int] = {}
            call_counters = {c["request"]: c["counters"] for c in args["calls"] if "counters" in c}
            for counted in call_counters.values():
                for key, value in counted.items():
                    counters[key] = counters.get(key, 0) + int(value)
            batch = int(args.get("batch", len(calls)))
            steps[stage].append(Step(ts, dur, batch, calls, counters, call_counters))
        elif name.startswith(("put ", "take ")):
            verb, channel = name.split(" ", 1)
            args = e["args"]
            key = (args["request"], int(args["chunk"]))
            trip = trips[channel].get(key)
            if trip is None:
                trip = trips[channel][key] = ChunkTrip(channel, key[0], key[1])
            size = int(args.get("bytes", 0))
            if verb == "put":
                trip.puts += 1
                trip.put_bytes += size
                trip.put_durs.append(dur)
                if trip.put is None or ts < trip.put:
                    trip.put, trip.put_dur = ts, dur
            else:
                trip.takes += 1
                trip.taken_bytes += size
                if trip.take is None or ts < trip.take:
                    trip.take = ts
    for stage_steps in steps.values():
        stage_steps.sort(key=lambda s: (s.ts, s.dur))
    feeds: dict[str, list[str]] = {}
    if plan is not None:
        stages = [s["name"] for s in plan["stages"]]
        stage_executor = {s["name"]: s["executor"] for s in plan["stages"]}
        inputs = [p["name"] for p in plan["inputs"]]
        outputs = [p["name"] for p in plan["outputs"]]
        channels = {
            c["name"]: ChannelInfo(c["name"], c["src"], c["dst"], c["kind"], c)
            for c in plan["channels"]
        }
        for c in channels.values():
            if c.kind == "local" and c.src in stage_executor and c.dst in stage_executor:
                feeds.setdefault(c.dst, []).append(c.src)
        executors = [p["name"] for p in plan["programs"]]
    else:
        known = set(steps) | set(started)
        channels = {}
        for name in trips:
            src, _, dst = name.partition("->")
            channels[name] = ChannelInfo(name, src.rsplit(".", 1)[0], dst.rsplit(".", 1)[0])
        inputs = sorted({c.src for c in channels.values()} - known)
        outputs = sorted({c.dst for c in channels.values()} - known)
        fed = {c.dst for c in channels.values()}
        feeds = _inferred_feeds(steps, started, stage_executor, [s for s in known if s not in fed])
        stages = graph_order(known, channels, feeds)
        executors = sorted(set(processes.values()))
    if lo > hi:
        lo = hi = 0.0
    return Profile(
        pipeline=other.get("pipeline", "") or (plan or {}).get("pipeline", ""),
        plan=plan,
        stages=stages,
        stage_executor=stage_executor,
        inputs=inputs,
        outputs=outputs,
        channels=channels,
        steps=dict(steps),
        trips=dict(trips),
        executors=executors,
        window=(lo, hi),
        dropped=dict(other.get("dropped", {})),
        feeds=feeds,
        recorded_from=recorded_from,
    )


def _inferred_feeds(
    steps: dict[str, list[Step]],
    started: dict[str, set[str]],
    stage_executor: dict[str, str],
    unfed: list[str],
) -> dict[str, list[str]]:
    """Without a plan: which stages feed each stage that no recorded channel feeds. Its
    input can only have come by reference from a stage of its own executor, one that must
    step a request before it can: U feeds X when the requests both stepped say U came first
    more often than not. A request says so by its first steps there when the executor
    recorded its `start` at both (that comes before its steps, so its first steps are in the
    trace), and by the steps that ended it at both (X cannot end a request before U has
    handed it the end). A request's other steps say nothing: an executor that began
    recording late, or overwrote its oldest events, lost its first steps, and its later steps
    at U can come after those at X."""
    first: dict[str, dict[str, float]] = defaultdict(dict)
    last: dict[str, dict[str, float]] = defaultdict(dict)
    for stage, stage_steps in steps.items():
        for step in stage_steps:  # sorted by time
            for rid, _emitted, ended in step.calls:
                first[stage].setdefault(rid, step.ts)
                if ended:
                    last[stage].setdefault(rid, step.ts)
    feeds: dict[str, list[str]] = {}
    for x in sorted(unfed):
        for u in sorted(steps):
            if u == x or stage_executor.get(u) != stage_executor.get(x):
                continue
            whole = started.get(u, set()) & started.get(x, set())
            votes = [first[u][r] - first[x][r] for r in whole & first[u].keys() & first[x].keys()]
            votes += [last[u][r] - last[x][r] for r in last[u].keys() & last[x].keys()]
            if sum(v < 0 for v in votes) > sum(v > 0 for v in votes):
                feeds.setdefault(x, []).append(u)
    return feeds


def graph_order(
    stages: set[str] | list[str], channels: dict[str, ChannelInfo], feeds: dict[str, list[str]]
) -> list[str]:
    """The stages upstream first: by their depth in the graph (the longest run of edges
    from a stage nothing feeds), then by name. A cycle (only a malformed trace has one) is
    broken at its stage with the fewest unplaced inputs."""
    stages = set(stages)
    parents: dict[str, set[str]] = {s: set() for s in stages}
    for c in channels.values():
        if c.src in stages and c.dst in stages and c.src != c.dst:
            parents[c.dst].add(c.src)
    for dst, srcs in feeds.items():
        if dst in stages:
            parents[dst] |= {s for s in srcs if s in stages and s != dst}
    depth: dict[str, int] = {}
    left = set(stages)
    while left:
        ready = sorted(s for s in left if parents[s] <= depth.keys())
        if not ready:  # a cycle: place the stage that waits on the fewest others
            ready = [min(left, key=lambda s: (len(parents[s] - depth.keys()), s))]
        for s in ready:
            depth[s] = 1 + max((depth[p] for p in parents[s] if p in depth), default=-1)
            left.discard(s)
    return sorted(stages, key=lambda s: (depth[s], s))


# --- requests ------------------------------------------------------------------------------------


def timelines(profile: Profile) -> list[RequestTimeline]:
    """Every request the trace saw, by the time its inputs went out."""
    calls: dict[str, dict[str, list[Call]]] = defaultdict(lambda: defaultdict(list))
    counted: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    for stage, stage_steps in profile.steps.items():
        for step in stage_steps:
            for rid, emitted, ended in step.calls:
                calls[rid][stage].append(Call(step.ts, step.ts + step.dur, emitted, ended))
            for rid, counters in step.call_counters.items():
                counted[rid][stage].update(counters)
    trips: dict[str, dict[str, list[ChunkTrip]]] = defaultdict(lambda: defaultdict(list))
    for channel, by_key in profile.trips.items():
        for trip in by_key.values():
            trips[trip.request][channel].append(trip)
    requests = []
    busy = Busy(profile)
    for rid in set(calls) | set(trips):
        request_trips = {c: sorted(t, key=lambda t: t.index) for c, t in trips[rid].items()}
        request_calls = {s: sorted(cs, key=lambda c: c.start) for s, cs in calls[rid].items()}
        request = _timeline(profile, rid, request_calls, request_trips, busy)
        request.counters = {stage: dict(c) for stage, c in counted.get(rid, {}).items()}
        requests.append(request)
    requests.sort(key=lambda r: (r.t0, r.id))
    return requests


def _timeline(
    profile: Profile,
    rid: str,
    calls: dict[str, list[Call]],
    trips: dict[str, list[ChunkTrip]],
    busy: Busy,
) -> RequestTimeline:
    channels = profile.channels
    input_puts = [
        t.put
        for c, ts in trips.items()
        if c in channels and channels[c].src in profile.inputs
        for t in ts
        if t.put is not None
    ]
    times = [c.start for cs in calls.values() for c in cs]
    times += [x for ts in trips.values() for t in ts for x in (t.put, t.take) if x is not None]
    t0 = min(input_puts) if input_puts else min(times)
    request = RequestTimeline(rid, t0, False, calls, trips)
    for channel, ts in trips.items():
        info = channels.get(channel)
        if info is None or info.dst not in profile.outputs:
            continue
        taken = [t for t in ts if t.take is not None]
        data = [t.take for t in taken if t.bytes > 0] or [t.take for t in taken]
        if data:
            request.first_out[info.dst] = min(data)
            last = max(t.take for t in taken)
            request.last_out = last if request.last_out is None else max(request.last_out, last)
    # Complete: its inputs went out, every stage that stepped it ended it, and every output
    # was taken (at least its end), with no chunk of one put and left untaken (cancelled).
    ended = all(any(c.ended for c in cs) for cs in calls.values())
    untaken = any(
        t.take is None
        for c, ts in trips.items()
        if c in channels and channels[c].dst in profile.outputs
        for t in ts
    )
    every_output = all(o in request.first_out for o in profile.outputs)
    request.complete = (
        bool(input_puts) and ended and every_output and not untaken and request.last_out is not None
    )
    if input_puts:
        request.ttfp = {o: t - t0 for o, t in request.first_out.items()}
    if request.complete:
        request.e2e = request.last_out - t0
    if input_puts:
        _critical_paths(profile, request, busy)
    return request


class Busy:
    """When each executor was stepping: merged intervals, for overlap queries."""

    def __init__(self, profile: Profile):
        spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for stage, stage_steps in profile.steps.items():
            executor = profile.stage_executor.get(stage, stage)
            spans[executor] += [(s.ts, s.ts + s.dur) for s in stage_steps]
        self.starts: dict[str, list[float]] = {}
        self.ends: dict[str, list[float]] = {}
        self.before: dict[str, list[float]] = {}  # busy time before each interval
        for executor, items in spans.items():
            merged: list[list[float]] = []
            for a, b in sorted(items):
                if merged and a <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], b)
                else:
                    merged.append([a, b])
            self.starts[executor] = [m[0] for m in merged]
            self.ends[executor] = [m[1] for m in merged]
            total, before = 0.0, []
            for a, b in merged:
                before.append(total)
                total += b - a
            self.before[executor] = before

    def _until(self, executor: str, t: float) -> float:
        starts = self.starts[executor]
        i = bisect.bisect_right(starts, t) - 1
        if i < 0:
            return 0.0
        return self.before[executor][i] + min(t, self.ends[executor][i]) - starts[i]

    def overlap(self, executor: str, a: float, b: float) -> float:
        """How long `executor` was stepping between a and b."""
        if executor not in self.starts or b <= a:
            return 0.0
        return self._until(executor, b) - self._until(executor, a)


# --- critical paths ------------------------------------------------------------------------------


def component_of_stage(stage: str, waiting: bool = False) -> str:
    return f"{stage}{WAITING}" if waiting else stage


def component_owner(component: str) -> tuple[str, str]:
    """A critical path's component as (its stage or edge, how): "waiting", "unrecorded", or
    "steps" for the owner's own time (a stage's steps, an edge's hand-offs)."""
    for suffix, how in ((WAITING, "waiting"), (UNRECORDED, "unrecorded")):
        if component.endswith(suffix):
            return component[: -len(suffix)], how
    return component, "steps"


def _critical_paths(profile: Profile, request: RequestTimeline, busy: Busy) -> None:
    channels = profile.channels
    out_trips = [
        t
        for c, ts in request.trips.items()
        if c in channels and channels[c].dst in profile.outputs
        for t in ts
        if t.take is not None
    ]
    if not out_trips:
        return
    walker = _Walker(profile, request, busy)
    if request.complete:
        last = max(out_trips, key=lambda t: (t.take, t.index))
        request.path_e2e, request.route = walker.walk(last)
    for output, first in request.first_out.items():
        trip = min(
            (t for t in out_trips if channels[t.channel].dst == output and t.take == first),
            key=lambda t: t.index,
        )
        request.path_ttfp[output], _ = walker.walk(trip)


class _Walker:
    """Walks one request's critical path backwards (see the module's docstring)."""

    def __init__(self, profile: Profile, request: RequestTimeline, busy: Busy):
        self.profile = profile
        self.busy = busy
        self.request = request
        self.calls = request.calls  # sorted by start: a stage steps a request one at a time
        self.ends = {s: [c.end for c in cs] for s, cs in self.calls.items()}
        # What reached each stage: (time, the trip, or (upstream stage, its call's index)).
        arrivals: dict[str, list[tuple[float, object]]] = defaultdict(list)
        for name, info in profile.channels.items():
            if info.kind != "local":
                for trip in request.trips.get(name, ()):
                    if trip.take is not None:
                        arrivals[info.dst].append((trip.take, trip))
        for dst, srcs in profile.feeds.items():
            for src in srcs:
                for i, call in enumerate(self.calls.get(src, ())):
                    if call.emitted > 0 or call.ended:  # a chunk, or the end, went downstream
                        arrivals[dst].append((call.end, (src, i)))
        for items in arrivals.values():
            items.sort(key=lambda a: a[0])
        self.arrivals = arrivals
        self.arrival_times = {s: [a[0] for a in items] for s, items in arrivals.items()}

    def _recording_late(self, executor: str | None) -> bool:
        """Whether `executor` began recording after this request's inputs went out (so what
        it did for the request before then is not in the trace)."""
        began = self.profile.recorded_from.get(executor, math.inf) if executor else math.inf
        return began > self.request.t0

    def walk(self, trip: ChunkTrip) -> tuple[dict[str, float], list[str]]:
        """The components of the time from the request's first input put to `trip`'s take
        (they add up to it), and the stages the path went through, upstream first."""
        profile, t0 = self.profile, self.request.t0
        spent: dict[str, float] = defaultdict(float)
        route: list[str] = []
        now = trip.take

        def move(to: float, component: str) -> None:
            """Charge the time from `to` (never later than now, nor before t0) to now."""
            nonlocal now
            to = min(max(to, t0), now)
            spent[component] += now - to
            now = to

        def hand_off(sent: float, channel: str, consumer: str) -> None:
            """A chunk from `sent` to now: the consumer's executor stepping is its waiting,
            the rest the edge's."""
            nonlocal now
            sent = min(max(sent, t0), now)
            executor = profile.stage_executor.get(consumer)
            busy = self.busy.overlap(executor, sent, now) if executor else 0.0
            busy = min(max(busy, 0.0), now - sent)
            spent[component_of_stage(consumer, True)] += busy
            spent[channel] += now - sent - busy
            now = sent

        rest = None  # what the time left before the cursor is charged to
        state: tuple = ("trip", trip)
        seen: set = set()
        while now > t0:
            key = (state[0], id(state[1]) if state[0] == "trip" else state[1:])
            if key in seen:  # only a malformed trace (a cycle of instants) comes back
                break
            seen.add(key)
            if state[0] == "trip":
                trip = state[1]
                info = profile.channels[trip.channel]
                if info.src in profile.inputs or info.src not in profile.stage_executor:
                    # From the request's inputs: the walk is done. An input put after the first
                    # (a chunked input) leaves the time since the first to the input's edge.
                    if trip.put is None:
                        rest = trip.channel + UNRECORDED
                    else:
                        hand_off(trip.put, trip.channel, info.dst)
                        rest = trip.channel + WAITING
                    break
                if trip.put is None:
                    # Put while its producer was not recording (before it began, after it
                    # stopped, or overwritten): so was the step that emitted it.
                    rest = info.src + UNRECORDED
                    break
                # The step that emitted the chunk: the last one to end before it was put.
                k = bisect.bisect_right(self.ends.get(info.src, []), trip.put + SLACK) - 1
                if k < 0:  # its producer's steps are not in the trace (overwritten)
                    hand_off(trip.put, trip.channel, info.dst)
                    rest = info.src + UNRECORDED
                    break
                hand_off(self.calls[info.src][k].end, trip.channel, info.dst)
                state = ("call", info.src, k)
            else:
                _, stage, k = state
                if not route or route[-1] != stage:
                    route.append(stage)
                call = self.calls[stage][k]
                move(call.start, stage)
                prev_end = self.ends[stage][k - 1] if k > 0 else None
                times = self.arrival_times.get(stage, [])
                j = bisect.bisect_right(times, call.start + SLACK) - 1
                if j >= 0 and (prev_end is None or times[j] > prev_end):
                    when, what = self.arrivals[stage][j]
                    move(when, component_of_stage(stage, True))
                    state = ("trip", what) if isinstance(what, ChunkTrip) else ("call", *what)
                elif prev_end is not None:
                    move(prev_end, component_of_stage(stage, True))
                    state = ("call", stage, k - 1)
                else:  # its first step, with no input recorded before it: the request
                    # began before its executor's recording did, or it waited that long
                    late = self._recording_late(profile.stage_executor.get(stage))
                    rest = stage + (UNRECORDED if late else WAITING)
                    break
        if now > t0:
            move(t0, rest or component_of_stage(route[-1] if route else trip.channel, True))
        route.reverse()
        return {k: v for k, v in spent.items() if v > 0}, route


# --- statistics ----------------------------------------------------------------------------------


def quantile(values: list[float], q: float) -> float | None:
    """The q-quantile (linear interpolation) of values, or None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def stage_stats(profile: Profile) -> list[dict]:
    span = max(profile.window[1] - profile.window[0], 1e-9)
    rows = []
    for stage in profile.stages:
        stage_steps = profile.steps.get(stage, [])
        durs = [s.dur for s in stage_steps]
        batches = Counter(s.batch for s in stage_steps)
        calls = sum(s.batch for s in stage_steps)
        rows.append(
            {
                "stage": stage,
                "executor": profile.stage_executor.get(stage, ""),
                "steps": len(stage_steps),
                "calls": calls,
                "requests": len({c[0] for s in stage_steps for c in s.calls}),
                "emitted": sum(c[1] for s in stage_steps for c in s.calls),
                "busy_us": sum(durs),
                "utilisation": sum(durs) / span,
                "step_mean_us": sum(durs) / len(durs) if durs else None,
                "step_p50_us": quantile(durs, 0.5),
                "step_p99_us": quantile(durs, 0.99),
                "batch_mean": calls / len(stage_steps) if stage_steps else None,
                "batch_max": max(batches, default=0),
                "batch_hist": {str(k): v for k, v in sorted(batches.items())},
                "counters": dict(sum((Counter(s.counters) for s in stage_steps), Counter())),
            }
        )
    return rows


def edge_stats(profile: Profile) -> list[dict]:
    """Per channel, from its put and take events: chunks put (one put event each), taken
    (chunks with a take, however many messages it came in), those only put (never taken:
    in flight when recording stopped, or dropped with a cancelled request) and those only
    taken (put before recording began), bytes put, put times, hand-offs (first take - put,
    of chunks with both) and the most chunks put and not yet taken at once."""
    rows = []
    for name, info in profile.channels.items():
        trips = list(profile.trips.get(name, {}).values())
        puts = [d for t in trips for d in t.put_durs]
        both = [t for t in trips if t.put is not None and t.take is not None]
        hand = [t.take - t.put for t in both]
        flight, peak = 0, 0
        # A chunk put is in flight until it is taken; at one instant, takes go first.
        moves = sorted(
            [(t.put, 1) for t in trips if t.put is not None] + [(t.take, -1) for t in both]
        )
        for _, delta in moves:
            flight += delta
            peak = max(peak, flight)
        plan = info.plan
        rows.append(
            {
                "edge": name,
                "src": info.src,
                "dst": info.dst,
                "kind": info.kind,
                "chunks": sum(t.puts for t in trips),
                "taken": sum(1 for t in trips if t.takes),
                "put_only": sum(1 for t in trips if t.puts and not t.takes),
                "take_only": sum(1 for t in trips if t.takes and not t.puts),
                "messages": sum(t.takes for t in trips),
                "bytes": sum(t.put_bytes for t in trips),
                "put_mean_us": sum(puts) / len(puts) if puts else None,
                "put_p99_us": quantile(puts, 0.99),
                "handoff_p50_us": quantile(hand, 0.5),
                "handoff_p99_us": quantile(hand, 0.99),
                "handoff_mean_us": sum(hand) / len(hand) if hand else None,
                "peak_in_flight": peak,
                "slots": plan.get("slots", 0),
                "slot_bytes": plan.get("slot_bytes", 0),
                "schedule": plan.get("schedule"),
            }
        )
    return rows
