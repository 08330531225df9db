"""Recorded events -> Chrome trace-event JSON, which Perfetto UI and chrome://tracing open.

One process per executor (the frontend too), one track per stage, one for the program's
channels and one for its loop's sleeps; with a GPU profile, one more for each CUDA stream of
a GPU executor, its kernels (gpu_timeline.py puts them on the same clock), named by the
stage that runs on it, so that the stages sharing a GPU show overlapping; on the frontend, one for
admission: per request, `admit` (checking it against the plan) then `queued` (until its
inputs go out). A stage step is a slice whose args name its batch: the requests in it and
what each emitted. A chunk is a slice on the channels track where it was put and another
where it was taken, joined by a flow arrow; its pass through an edge's adapter or map chain
is a slice (`adapt ...`, `map ...`) on the channels track where that ran. Timestamps are the
host's monotonic clock in microseconds, shared by every executor of the host.

Counters, derived from the same events when the trace is made (nothing more is recorded):
per channel, the chunks put and not yet taken (in its ring or waiting in the producer's
outbox for credits), on the producer's process; per stage, the requests it holds (started,
not ended), on its executor's process. Given the plan, the trace carries it in `otherData`
so a report can be made from the trace file alone (`omniflow profile`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import msgspec

from omniflow.plan import Plan
from omniflow.profiler.analysis import tracks_named
from omniflow.runtime import events
from omniflow.runtime.control import Profiled
from omniflow.runtime.events import RecordedEvents

LOOP_TRACK, CHANNEL_TRACK, GPU_TRACK, ADMISSION_TRACK = 0, 1, 2, 3
GPU_STREAM_TRACKS = 4  # a GPU's further streams: GPU_STREAM_TRACKS + 1, + 2, ...


def chrome_trace(
    profiles: list[Profiled], pipeline: str | Plan = "", plan: Plan | None = None
) -> dict:
    """Every executor's events in one trace (dict ready for `json.dump`). `pipeline` names
    the pipeline, or is its plan; a plan (either way) goes into `otherData["plan"]`."""
    if isinstance(pipeline, Plan):
        pipeline, plan = pipeline.pipeline, pipeline
    trace: list[dict] = []
    received: set[tuple] = set()
    for pid, profile in enumerate(sorted(profiles, key=lambda p: p.executor), start=1):
        trace += _process(pid, profile, received)
    trace += counters(trace)
    other: dict = {"pipeline": pipeline or (plan.pipeline if plan else ""), "clock": "monotonic"}
    other["dropped"] = {p.executor: p.dropped for p in profiles if p.dropped}
    if plan is not None:
        other["plan"] = msgspec.to_builtins(plan)
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": other}


def write_trace(
    profiles: list[Profiled], path: str | Path, pipeline: str | Plan = "", plan: Plan | None = None
) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(profiles, pipeline, plan)), encoding="utf-8")
    return path


def counters(trace: list[dict]) -> list[dict]:
    """Counter events ("ph": "C") from a trace's slices: each channel's chunks in flight
    (put, not yet taken) on its producer's process, each stage's requests held (from its
    `start` instant, or its first step, to the step that ended the request)."""
    changes: list[tuple[float, int, str, str, int]] = []  # ts, pid, name, arg, +1/-1
    put_by: dict[tuple, int] = {}
    taken: set[tuple] = set()
    track_names = tracks_named(trace)
    held: dict[tuple[str, str], int] = {}  # (stage, request) -> pid, while held
    for e in sorted((e for e in trace if e["ph"] in "Xi"), key=lambda e: e["ts"]):
        name, pid = e["name"], e["pid"]
        if e["ph"] == "X" and name.startswith(("put ", "take ")):
            verb, channel = name.split(" ", 1)
            key = (channel, e["args"]["request"], e["args"]["chunk"])
            if verb == "put":
                put_by[key] = pid
                changes.append((e["ts"], pid, f"in flight {channel}", "chunks", 1))
            elif key in put_by and key not in taken:
                taken.add(key)
                changes.append((e["ts"], put_by[key], f"in flight {channel}", "chunks", -1))
        elif e["ph"] == "i" and name.startswith("start "):
            stage = track_names.get((pid, e["tid"]))
            key = (stage, name[len("start ") :])
            if stage is not None and key not in held:
                held[key] = pid
                changes.append((e["ts"], pid, f"requests {stage}", "held", 1))
        elif e["ph"] == "X" and name.endswith(" step"):
            stage = name[: -len(" step")]
            for call in e["args"].get("calls", ()):
                key = (stage, call["request"])
                if key not in held:
                    held[key] = pid
                    changes.append((e["ts"], pid, f"requests {stage}", "held", 1))
                if call["ended"] and held.get(key) is not None:
                    held[key] = None
                    changes.append((e["ts"] + e["dur"], pid, f"requests {stage}", "held", -1))
    out, level = [], defaultdict(int)
    for ts, pid, name, arg, delta in sorted(changes, key=lambda c: c[0]):
        level[pid, name] += delta
        out.append({"ph": "C", "name": name, "pid": pid, "ts": ts, "args": {arg: level[pid, name]}})
    return out


def _kernel_tracks(pid: int, profile: Profiled, out: list[dict]) -> dict[int, str]:
    """The GPU timeline's slices, one track per (device, stream): the first GPU_TRACK, the
    others after the fixed tracks, named by the stage that runs on the stream where the
    profile knows it (those first, by stage name), so that the stages'
    overlap shows."""
    stage_of = dict(profile.streams)
    keys = sorted(
        {(device, stream) for *_, device, stream in profile.kernels},
        key=lambda k: (k[1] not in stage_of, stage_of.get(k[1], ""), k),
    )
    tids = {key: GPU_TRACK if i == 0 else GPU_STREAM_TRACKS + i for i, key in enumerate(keys)}
    for name, start, dur, device, stream in profile.kernels:
        args = {"device": device, "stream": stream}
        out.append(_slice(pid, tids[device, stream], name, start / 1e3, dur, args))
    return {
        tid: f"gpu {device} stream {stream}: " + (
            f"{stage_of[stream]}'s kernels" if stream in stage_of else "kernels"
        )
        for (device, stream), tid in tids.items()
    }  # fmt: skip


def _process(pid: int, profile: Profiled, received: set[tuple]) -> list[dict]:
    recorded = RecordedEvents(profile.names, profile.requests, profile.rows, profile.dropped)
    names, requests = recorded.names, recorded.requests
    tracks = {LOOP_TRACK: "loop", CHANNEL_TRACK: "channels"}
    track_of: dict[str, int] = {}
    out = [_meta(pid, 0, "process_name", profile.executor)]
    if profile.kernels:
        tracks.update(_kernel_tracks(pid, profile, out))
    calls: dict[tuple[str, int], list] = defaultdict(list)
    rows = recorded.events()
    if any(kind == events.ADMIT for _t, _dur, kind, *_ in rows):
        tracks[ADMISSION_TRACK] = "admission"
    counted: dict[tuple[str, int, int], dict[str, int]] = defaultdict(dict)
    for t, _dur, kind, what, request, n, m in rows:
        if kind == events.COUNT and 0 <= n < len(events.COUNTERS):
            counted[names[what], t, request][events.COUNTERS[n]] = m
    for t, _dur, kind, what, request, n, m in rows:
        if kind == events.CALL:
            call = {"request": requests[request], "emitted": n, "ended": bool(m)}
            if (names[what], t, request) in counted:
                call["counters"] = counted[names[what], t, request]
            calls[names[what], t].append(call)
    for t, dur, kind, what, request, n, m in rows:
        name = names[what] if what >= 0 else ""
        rid = requests[request] if request >= 0 else None
        ts = t / 1e3
        if kind in (events.STEP, events.START):
            tid = track_of.setdefault(name, max(tracks) + 1 + len(track_of))
            if kind == events.STEP:
                args = {"batch": n, "calls": calls.get((name, t), [])}
                out.append(_slice(pid, tid, f"{name} step", ts, dur, args))
            else:
                out.append(
                    {"ph": "i", "s": "t", "name": f"start {rid}", "pid": pid, "tid": tid, "ts": ts}
                )
        elif kind in (events.SEND, events.RECV):
            flow = f"{name}|{rid}|{m}"
            args = {"request": rid, "bytes": n, "chunk": m}
            verb = "put" if kind == events.SEND else "take"
            out.append(_slice(pid, CHANNEL_TRACK, f"{verb} {name}", ts, dur, args))
            if kind == events.SEND:
                out.append(_flow("s", pid, flow, ts, name))
            elif flow not in received:  # a long text chunk can arrive as several messages
                received.add(flow)
                out.append(_flow("f", pid, flow, ts, name))
        elif kind == events.WAIT:
            out.append(_slice(pid, LOOP_TRACK, "idle", ts, dur, {}))
        elif kind == events.ADAPT:
            verb = "adapt" if m == events.ADAPTER else "map"
            args = {"request": rid, "chunk": n}
            out.append(_slice(pid, CHANNEL_TRACK, f"{verb} {name}", ts, dur, args))
        elif kind == events.ADMIT:  # n: the admission check, the rest of dur: queued
            args = {"request": rid}
            out.append(_slice(pid, ADMISSION_TRACK, f"admit {rid}", ts, n, args))
            out.append(_slice(pid, ADMISSION_TRACK, f"queued {rid}", ts + n / 1e3, dur - n, args))
    for tid, track in [*tracks.items(), *((t, n) for n, t in track_of.items())]:
        out.append(_meta(pid, tid, "thread_name", track))
    return out


def _slice(pid: int, tid: int, name: str, ts: float, dur: int, args: dict) -> dict:
    return {
        "ph": "X",
        "name": name,
        "pid": pid,
        "tid": tid,
        "ts": ts,
        "dur": max(dur / 1e3, 0.001),
        "args": args,
    }


def _flow(phase: str, pid: int, flow: str, ts: float, channel: str) -> dict:
    event = {
        "ph": phase,
        "id": flow,
        "cat": "chunk",
        "name": channel,
        "pid": pid,
        "tid": CHANNEL_TRACK,
        "ts": ts,
    }
    if phase == "f":
        event["bp"] = "e"  # binds to the enclosing slice: the take
    return event


def _meta(pid: int, tid: int, kind: str, name: str) -> dict:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}
