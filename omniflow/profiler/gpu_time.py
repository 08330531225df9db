"""Where a GPU profile's kernel time went: each GPU stream's busy time (its stage's, where the
trace names it) and its costliest kernels, and the GPU's busy time, all streams together,
over the span the kernels cover.

Read from a trace written with the kernels (`--profile-gpu`, `POST /start_profile {"gpu":
true}`): each (process, GPU stream) is a track named "gpu D stream S: <stage>'s kernels"
(trace.py). A stream's busy time is the union of its kernels' intervals; the GPU's, the union
over every stream of one process. A GPU kept busy near its span is the bound of what the
plan serves; a stage's share of it is what shrinking that stage would give back. Times are
microseconds on the trace's clock.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from omniflow.profiler.analysis import process_names, tracks_named


@dataclass
class StreamTime:
    """One GPU stream's kernels: their busy time (intervals merged), how many, and the
    total duration by kernel name."""

    track: str
    busy: float
    kernels: int
    by_name: dict[str, float]

    def costliest(self, count: int) -> list[tuple[str, float]]:
        return sorted(self.by_name.items(), key=lambda kv: -kv[1])[:count]


@dataclass
class GpuTime:
    """A process's GPU time: `busy` (any stream running a kernel) over `span` (first
    kernel's start to last one's end), and each stream's."""

    process: str
    span: float
    busy: float
    streams: list[StreamTime]


def gpu_time(trace: dict) -> list[GpuTime]:
    """Each process of `trace` with GPU kernels, by busiest stream first within it."""
    events = trace.get("traceEvents", [])
    names, processes = tracks_named(events), process_names(events)
    slices: dict[int, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for e in events:
        track = names.get((e.get("pid"), e.get("tid")), "")
        if e.get("ph") == "X" and track.startswith("gpu "):
            slices[e["pid"]][track].append(e)
    found = []
    for pid, tracks in slices.items():
        streams = []
        for track, kernels in tracks.items():
            by_name: dict[str, float] = defaultdict(float)
            for k in kernels:
                by_name[k["name"]] += k["dur"]
            busy = _union([(k["ts"], k["ts"] + k["dur"]) for k in kernels])
            streams.append(StreamTime(track, busy, len(kernels), dict(by_name)))
        every = [(k["ts"], k["ts"] + k["dur"]) for kernels in tracks.values() for k in kernels]
        span = max(end for _, end in every) - min(start for start, _ in every)
        streams.sort(key=lambda s: -s.busy)
        found.append(GpuTime(processes.get(pid, str(pid)), span, _union(every), streams))
    return found


def _union(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of `intervals` (start, end)."""
    total, reached = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reached:
            total += end - max(start, reached)
            reached = end
    return total


def format_gpu_time(found: list[GpuTime], count: int = 5) -> str:
    """A table per process: the GPU's busy share of the span, then each stream's busy ms,
    share of the span, kernels, and its `count` costliest kernels by total ms."""
    lines = []
    for process in found:
        lines.append(
            f"{process.process}: GPU busy {process.busy / 1e3:.1f} of {process.span / 1e3:.1f} ms"
            f" ({process.busy / process.span:.0%}; a kernel on any stream)"
            if process.span
            else f"{process.process}: no kernel time"
        )
        for stream in process.streams:
            share = stream.busy / process.span if process.span else 0.0
            lines.append(
                f"  {stream.track}: busy {stream.busy / 1e3:.1f} ms ({share:.0%}),"
                f" {stream.kernels} kernels"
            )
            for name, total in stream.costliest(count):
                lines.append(f"    {total / 1e3:10.1f} ms  {name[:100]}")
    return "\n".join(lines)
