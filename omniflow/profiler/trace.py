"""Recorded events -> Chrome trace-event JSON, which Perfetto UI and chrome://tracing open.

One process per executor (the frontend too), one track per stage, one for the program's
channels and one for its loop's sleeps. A stage step is a slice whose args name its batch:
the requests in it and what each emitted. A chunk is a slice on the channels track where it
was put and another where it was taken, joined by a flow arrow. Timestamps are the hosts's
monotonic clock in microseconds, shared by every executor of the host.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from omniflow.runtime import events
from omniflow.runtime.control import Profiled
from omniflow.runtime.events import RecordedEvents

LOOP_TRACK, CHANNEL_TRACK = 0, 1


def chrome_trace(profiles: list[Profiled], pipeline: str = "") -> dict:
    """Every executor's events in one trace (dict ready for `json.dump`)."""
    trace: list[dict] = []
    received: set[tuple] = set()
    for pid, profile in enumerate(sorted(profiles, key=lambda p: p.executor), start=1):
        trace += _process(pid, profile, received)
    return {
        "traceEvents": trace,
        "displayTimeUnit": "ms",
        "otherData": {"pipeline": pipeline, "clock": "monotonic"},
    }


def write_trace(profiles: list[Profiled], path: str | Path, pipeline: str = "") -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(profiles, pipeline)), encoding="utf-8")
    return path


def _process(pid: int, profile: Profiled, received: set[tuple]) -> list[dict]:
    recorded = RecordedEvents(profile.names, profile.requests, profile.rows, profile.dropped)
    names, requests = recorded.names, recorded.requests
    tracks = {LOOP_TRACK: "loop", CHANNEL_TRACK: "channels"}
    track_of: dict[str, int] = {}
    out = [_meta(pid, 0, "process_name", profile.executor)]
    calls: dict[tuple[str, int], list] = defaultdict(list)
    rows = recorded.events()
    for t, _dur, kind, what, request, n, m in rows:
        if kind == events.CALL:
            calls[names[what], t].append(
                {"request": requests[request], "emitted": n, "ended": bool(m)}
            )
    for t, dur, kind, what, request, n, m in rows:
        name = names[what] if what >= 0 else ""
        rid = requests[request] if request >= 0 else None
        ts = t / 1e3
        if kind in (events.STEP, events.START):
            tid = track_of.setdefault(name, len(tracks) + len(track_of))
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
