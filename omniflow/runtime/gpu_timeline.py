"""The GPU half of a profile (`--profile-gpu`): the torch profiler's CUDA kernel timeline of
one executor, on the clock every other event of the profile uses.

Clock alignment. The events of events.py are stamped with `time.monotonic_ns()`. The torch
profiler (kineto) stamps its events in Unix-epoch nanoseconds: its approximate clock (the
CPU's time-stamp counter) is calibrated against the system clock, and CUPTI's GPU
timestamps are converted onto that same host clock before they reach kineto, so kernels and
CPU ops share it. Mapping one onto the other therefore needs one offset, wall clock minus
monotonic clock. It is read as a monotonic reading, a wall-clock reading, a monotonic
reading; the pair from the narrowest of a few tries is kept (the error is at most half that
window, a fraction of a microsecond), once when the profile starts and once when it stops.
Their mean is the offset: a wall clock slewed by NTP in between moves it by half the drift,
not all of it.

Streams. Each stage of a GPU executor runs on a CUDA stream of its own (streams.py), and
each kernel is recorded with the stream that ran it (kineto's resource id: CUPTI's stream
id), so the trace gives each stream a track and the stages' overlap shows. Which stage a
stream is: when the profile starts, the GPU is drained and each stage's stream runs one tiny
kernel alone, between two monotonic readings; the stream of the kernel that ran in a
stage's window is that stage's (`streams`). Once per profile, never on a serving path.
"""

from __future__ import annotations

import time

from omniflow.errors import OmniflowError
from omniflow.plan import Plan, Program

# name, start (monotonic ns), duration ns, device index, stream (CUPTI's id; off CUDA, the
# recording thread's)
Kernel = tuple[str, int, int, int, int]


class ProfileError(OmniflowError):
    """A profile was asked for that this plan or machine cannot record; `param`: the option
    at fault (the server's 400 names it)."""

    def __init__(self, message: str, param: str = "gpu"):
        super().__init__(message)
        self.param = param


def on_cuda(program: Program) -> bool:
    return any(d.startswith("cuda") for d in program.devices)


def gpu_executors(plan: Plan) -> list[str]:
    """The executors whose stages run on CUDA; ProfileError when there is none (a kernel
    timeline needs a GPU stage) or when this torch has no CUDA."""
    found = [p.name for p in plan.executors if on_cuda(p)]
    if not found:
        raise ProfileError(
            "--profile-gpu records the CUDA kernels of GPU stages, and this plan places every "
            f"stage on the CPU (compiled for devices {', '.join(d.name for d in plan.devices)}); "
            "profile without it, or compile with --devices for a GPU"
        )
    import torch

    if not torch.cuda.is_available():
        raise ProfileError(
            "--profile-gpu needs CUDA, and this torch sees no CUDA device "
            f"(torch {torch.__version__})"
        )
    return found


def clock_offset(tries: int = 5) -> tuple[int, int]:
    """(wall minus monotonic ns, window ns) from the narrowest of `tries` readings."""
    best = None
    for _ in range(tries):
        before = time.monotonic_ns()
        wall = time.time_ns()
        after = time.monotonic_ns()
        if best is None or after - before < best[1]:
            best = (wall - (before + after) // 2, after - before)
    return best


class KernelTimeline:
    """The torch profiler over this process, from `start` to `stop`. `devices` picks the
    activity: "cuda" records the GPU's kernels, memory copies and sets (what the kernel
    track shows); "cpu" records torch's CPU ops, which is how a machine without CUDA tests
    the merge (same profiler, same clock)."""

    def __init__(self, devices: str = "cuda"):
        from torch.profiler import ProfilerActivity, profile

        activity = ProfilerActivity.CUDA if devices == "cuda" else ProfilerActivity.CPU
        self.device_type = devices.upper()
        self.profiler = profile(activities=[activity])
        self.offset_at_start = 0
        self.marks: list[tuple[str, int, int]] = []  # stage, monotonic ns before and after
        self.streams: dict[int, str] = {}  # stream -> its stage, found by `stop`

    def start(self, stages: dict | None = None) -> None:
        """Start recording; `stages`: each stage's CUDA stream (torch.cuda.Stream), marked
        so that `stop` can name their tracks."""
        self.profiler.start()
        self.offset_at_start = clock_offset()[0]
        if stages:
            import torch

            torch.cuda.synchronize()  # nothing else runs during the marks
            for stage, stream in stages.items():
                with torch.cuda.stream(stream):
                    before = time.monotonic_ns()
                    torch.empty(1, device=stream.device).fill_(0)
                    stream.synchronize()
                    self.marks.append((stage, before, time.monotonic_ns()))

    def stop(self) -> list[Kernel]:
        """The events recorded, oldest first, their start on the monotonic clock; the
        markers `start` ran to name the streams are not among them (no stage's work)."""
        if self.device_type == "CUDA":
            import torch

            torch.cuda.synchronize()  # kernels still queued would be missing
        offset = (self.offset_at_start + clock_offset()[0]) // 2
        self.profiler.stop()
        found = sorted(
            (
                (e.name(), e.start_ns() - offset, e.duration_ns(), e.device_index(), stream)
                for e in self.profiler.profiler.kineto_results.events()
                if e.device_type().name == self.device_type
                for stream in [e.device_resource_id()]
            ),
            key=lambda k: k[1],
        )
        self.streams = named_streams(found, self.marks)
        return [k for k in found if not any(b <= k[1] <= a for _, b, a in self.marks)]


def named_streams(kernels: list[Kernel], marks: list[tuple[str, int, int]]) -> dict[int, str]:
    """Each marked stage's stream: that of the first kernel that began within the stage's
    mark (`marks`: stage, monotonic ns before and after its marker ran alone)."""
    streams: dict[int, str] = {}
    for stage, before, after in marks:
        stream = next((k[4] for k in kernels if before <= k[1] <= after), None)
        if stream is not None and stream not in streams:
            streams[stream] = stage
    return streams
