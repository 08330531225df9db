"""A Chrome trace (trace.py) read back into what the report shows: every request's timeline
(its calls at each stage, its chunks on each edge, when its outputs began and ended), per-stage
and per-edge statistics, and each request's critical path.

Everything here reads the trace file alone: the plan comes from `otherData["plan"]` when the
trace carries it; without it, stages are the tracks that stepped and channels are named
`src.port->dst.port`. Times are microseconds on the trace's clock.

The critical path of a request to one of its output chunks is walked backwards from the
frontend's take of that chunk: a chunk leads to the step that emitted it (the time between
is the edge's hand-off, but for the part of it the consumer's executor spent stepping, which
is the consumer's waiting), a step leads to whichever finished last before it began — the
arrival of its input from upstream (the path moves upstream) or the stage's own previous
step of the request (it stays) — and the gap between is the stage's waiting (for its turn
in a batch, for the other stages of its executor). The walk ends at the request's inputs.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field


@dataclass
class Step:
    ts: float
    dur: float
    batch: int
    calls: list[tuple[str, int, bool]]  # (request, emitted, ended)


@dataclass
class ChunkTrip:
    """One chunk of one request on one channel: when it was put and taken."""

    channel: str
    request: str
    index: int
    bytes: int = 0
    put: float | None = None
    put_dur: float = 0.0
    take: float | None = None


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


@dataclass
class Profile:
    """A trace parsed: its plan (or None), stages, channels, steps, chunk trips."""

    pipeline: str
    plan: dict | None
    stages: list[str]
    stage_executor: dict[str, str]
    inputs: list[str]
    outputs: list[str]
    channels: dict[str, ChannelInfo]
    steps: dict[str, list[Step]]
    trips: dict[str, dict[tuple[str, int], ChunkTrip]]
    executors: list[str]
    window: tuple[float, float]
    dropped: dict[str, int]


def parse_trace(trace: dict) -> Profile:
    other = trace.get("otherData", {})
    plan = other.get("plan")
    events = trace.get("traceEvents", [])
    processes = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e["name"] == "process_name"
    }
    steps: dict[str, list[Step]] = defaultdict(list)
    trips: dict[str, dict[tuple[str, int], ChunkTrip]] = defaultdict(dict)
    stage_executor: dict[str, str] = {}
    lo, hi = math.inf, -math.inf
    for e in events:
        ph, name = e.get("ph"), e.get("name", "")
        if ph != "X":
            continue
        ts = float(e["ts"])
        end = ts + float(e.get("dur", 0.0))
        lo, hi = min(lo, ts), max(hi, end)
        if name.endswith(" step"):
            stage = name[:-5]
            stage_executor.setdefault(stage, processes.get(e["pid"], str(e["pid"])))
            args = e.get("args", {})
            calls = [(c["request"], int(c["emitted"]), bool(c["ended"])) for c in args["calls"]]
            steps[stage].append(
                Step(ts, float(e["dur"]), int(args.get("batch", len(calls))), calls)
            )
        elif name.startswith(("put ", "take ")):
            verb, channel = name.split(" ", 1)
            args = e["args"]
            key = (args["request"], int(args["chunk"]))
            trip = trips[channel].get(key)
            if trip is None:
                trip = trips[channel][key] = ChunkTrip(channel, key[0], key[1])
            if verb == "put":
                trip.put, trip.put_dur, trip.bytes = ts, float(e["dur"]), int(args["bytes"])
            elif trip.take is None or ts < trip.take:
                trip.take = ts
                trip.bytes = trip.bytes or int(args["bytes"])
    for stage_steps in steps.values():
        stage_steps.sort(key=lambda s: s.ts)
    if plan is not None:
        stages = [s["name"] for s in plan["stages"]]
        stage_executor = {s["name"]: s["executor"] for s in plan["stages"]}
        inputs = [p["name"] for p in plan["inputs"]]
        outputs = [p["name"] for p in plan["outputs"]]
        channels = {
            c["name"]: ChannelInfo(c["name"], c["src"], c["dst"], c["kind"], c)
            for c in plan["channels"]
        }
        executors = [p["name"] for p in plan["programs"]]
    else:
        stages = sorted(steps, key=lambda s: steps[s][0].ts if steps[s] else 0)
        channels = {}
        for name in trips:
            src, _, dst = name.partition("->")
            channels[name] = ChannelInfo(name, src.rsplit(".", 1)[0], dst.rsplit(".", 1)[0])
        inputs = sorted({c.src for c in channels.values()} - set(stages))
        outputs = sorted({c.dst for c in channels.values()} - set(stages))
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
    )


# --- requests ------------------------------------------------------------------------------------


def timelines(profile: Profile) -> list[RequestTimeline]:
    """Every request the trace saw, by the time its inputs went out."""
    calls: dict[str, dict[str, list[Call]]] = defaultdict(lambda: defaultdict(list))
    for stage, stage_steps in profile.steps.items():
        for step in stage_steps:
            for rid, emitted, ended in step.calls:
                calls[rid][stage].append(Call(step.ts, step.ts + step.dur, emitted, ended))
    trips: dict[str, dict[str, list[ChunkTrip]]] = defaultdict(lambda: defaultdict(list))
    for channel, by_key in profile.trips.items():
        for trip in by_key.values():
            trips[trip.request][channel].append(trip)
    requests = []
    busy = Busy(profile)
    for rid in set(calls) | set(trips):
        request_trips = {c: sorted(t, key=lambda t: t.index) for c, t in trips[rid].items()}
        requests.append(_timeline(profile, rid, dict(calls[rid]), request_trips, busy))
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
            request.first_out[info.dst] = min(data, default=None)
            last = max(t.take for t in taken)
            request.last_out = last if request.last_out is None else max(request.last_out, last)
    ended = all(any(c.ended for c in cs) for cs in calls.values())
    request.complete = bool(input_puts) and ended and request.last_out is not None
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
    return f"{stage} (waiting)" if waiting else stage


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
        last = max(out_trips, key=lambda t: t.take)
        request.path_e2e, route = walker.walk(last)
        request.route = route
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
        self.calls = {s: sorted(cs, key=lambda c: c.start) for s, cs in request.calls.items()}
        self.ends = {s: [c.end for c in cs] for s, cs in self.calls.items()}
        # What reached each stage: (time, channel, trip or the upstream call's index).
        arrivals: dict[str, list[tuple[float, str, object]]] = defaultdict(list)
        for name, info in profile.channels.items():
            if info.kind == "local" and info.src in self.calls:
                for i, call in enumerate(self.calls[info.src]):
                    if call.emitted > 0:
                        arrivals[info.dst].append((call.end, name, i))
            else:
                for trip in request.trips.get(name, ()):
                    if trip.take is not None:
                        arrivals[info.dst].append((trip.take, name, trip))
        for items in arrivals.values():
            items.sort(key=lambda a: a[0])
        self.arrivals = arrivals
        self.arrival_times = {s: [a[0] for a in items] for s, items in arrivals.items()}

    def walk(self, trip: ChunkTrip) -> tuple[dict[str, float], list[str]]:
        spent: dict[str, float] = defaultdict(float)
        route: list[str] = []
        state: tuple = ("trip", trip)
        for _ in range(1_000_000):  # bounded: each move goes back in time
            if state[0] == "trip":
                trip = state[1]
                info = self.profile.channels[trip.channel]
                up = self.ends.get(info.src)
                if up is None or trip.put is None:  # from an input: the walk is done
                    if trip.put is not None and trip.take is not None:
                        spent[trip.channel] += trip.take - trip.put
                    break
                k = bisect.bisect_right(up, trip.put) - 1
                if k < 0:
                    break
                sent = self.calls[info.src][k].end
                consumer = self.profile.stage_executor.get(info.dst)
                busy = self.busy.overlap(consumer, sent, trip.take) if consumer else 0.0
                if busy > 0:
                    spent[component_of_stage(info.dst, True)] += busy
                spent[trip.channel] += trip.take - sent - busy
                state = ("call", info.src, k)
            else:
                _, stage, k = state
                if not route or route[-1] != stage:
                    route.append(stage)
                call = self.calls[stage][k]
                spent[stage] += call.end - call.start
                prev_end = self.calls[stage][k - 1].end if k > 0 else None
                times = self.arrival_times.get(stage, [])
                j = bisect.bisect_right(times, call.start) - 1
                if j >= 0 and (prev_end is None or times[j] > prev_end):
                    when, channel, what = self.arrivals[stage][j]
                    spent[component_of_stage(stage, True)] += call.start - when
                    if isinstance(what, ChunkTrip):
                        state = ("trip", what)
                    else:
                        src = self.profile.channels[channel].src
                        spent[channel] += 0.0
                        state = ("call", src, what)
                elif prev_end is not None:
                    spent[component_of_stage(stage, True)] += call.start - prev_end
                    state = ("call", stage, k - 1)
                else:
                    break
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
            }
        )
    return rows


def edge_stats(profile: Profile) -> list[dict]:
    rows = []
    for name, info in profile.channels.items():
        trips = list(profile.trips.get(name, {}).values())
        puts = [t.put_dur for t in trips if t.put is not None]
        hand = [t.take - t.put for t in trips if t.put is not None and t.take is not None]
        flight, peak = 0, 0
        moves = sorted(
            [(t.put, 1) for t in trips if t.put is not None]
            + [(t.take, -1) for t in trips if t.put is not None and t.take is not None]
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
                "chunks": len(trips),
                "bytes": sum(t.bytes for t in trips),
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
