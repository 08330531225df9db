"""`omniflow run --once`: one request through a real engine, its outputs written as files.

The order is the user's: everything that can be checked without running is checked first
(the output folder, the request against the plan, then devices, models and speakers), so a
mistake costs a second and writes nothing. Models load behind a progress bar, text streams
to the terminal as it is produced, and the run ends with its seed (to replay it) and its
latencies: time to first token (TTFT), to first audio packet (TTFP), end to end (E2E) and
the real-time factor (E2E over the audio's duration).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from omniflow.errors import OmniflowError
from omniflow.media import mp4_bytes, png_bytes, wav_bytes
from omniflow.plan import Plan, PortPlan
from omniflow.profiler.capture import profile_to
from omniflow.runtime import control
from omniflow.runtime.engine import Engine
from omniflow.runtime.gpu_timeline import gpu_executors
from omniflow.runtime.port_values import concat
from omniflow.runtime.preflight import preflight
from omniflow.runtime.prompts import prompt_limits
from omniflow.runtime.requests import admit, check_request

DEFAULT_RATE = 24000
# A video output whose program gives no `fps`: Wan2.2-A14B's (and the peer client's) default.
DEFAULT_FPS = 16


class OutputFolderError(OmniflowError):
    """The folder for a run's outputs cannot be created or written."""


def check_out_dir(path: Path) -> None:
    """Fail now, not after the run, if `path` cannot become a folder we can write into."""
    if path.exists():
        if not path.is_dir():
            raise OutputFolderError(f"--out {path}: exists and is not a folder")
        existing = path
    else:
        existing = next(p for p in path.absolute().parents if p.exists())
        if not existing.is_dir():
            raise OutputFolderError(f"--out {path}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputFolderError(f"--out {path}: {existing} is not writable")


@dataclass
class Timeline:
    """When a request's outputs arrived, from its submission."""

    began: float = field(default_factory=time.perf_counter)
    first: dict[str, float] = field(default_factory=dict)  # output type -> first chunk
    ended: float | None = None

    def saw(self, port_type: str) -> None:
        self.first.setdefault(port_type, time.perf_counter() - self.began)

    def end(self) -> None:
        self.ended = time.perf_counter() - self.began


def run_once(
    plan: Plan,
    inputs: dict,
    params: dict,
    out_dir: Path,
    *,
    mode: str = "process",
    backends: str = "auto",
    load: str = "sequential",
    console: Console,
    profile: Path | None = None,
    profile_gpu: bool = False,
) -> int:
    for folder in (out_dir, profile):
        if folder is not None:
            check_out_dir(folder)
    if profile_gpu:
        gpu_executors(plan)  # before any model loads: a plan with no GPU stage says so now
    request = admit(plan, inputs, params)  # a mistake costs a second: before any model loads
    checks = () if backends == "standin" else preflight(plan)
    check_request(request, checks)
    for limit in () if backends == "standin" else prompt_limits(plan):
        limit.check(request)
    types = {o.name: o.type for o in plan.outputs}
    parts: dict[str, list] = {name: [] for name in types}
    live = next((o.name for o in plan.outputs if o.type == "text"), None)  # shown as it comes
    with _loading(plan, console) as on_loaded:
        engine = Engine(plan, mode, backends, checks=checks, on_loaded=on_loaded, load=load)
    recording = (
        contextlib.nullcontext()
        if profile is None
        else profile_to(profile, engine, gpu=profile_gpu)
    )
    with engine, recording as profiled:
        timeline = Timeline()
        for chunk in engine.stream_sync(request):
            if chunk.value is None:
                continue
            timeline.saw(types[chunk.output])
            parts[chunk.output].append(chunk.value)
            if chunk.output == live:
                sys.stdout.write(chunk.value)
                sys.stdout.flush()
        timeline.end()
    if parts.get(live):
        sys.stdout.write("\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    audio_seconds = 0.0
    for port in plan.outputs:
        values = parts[port.name]
        value = concat(port.type, values) if values else None
        path, data = _file(port, value)
        (out_dir / path).write_bytes(data)
        empty = " (empty: the pipeline produced nothing for it)" if value is None else ""
        console.print(f"{port.name}: {out_dir / path}{empty}", soft_wrap=True)
        if port.type == "audio" and value is not None:
            audio_seconds += value.numel() / _rate(port)
    console.print(_summary(request.seed, timeline, audio_seconds), soft_wrap=True)
    if profiled is not None:
        console.print(f"profile: {profiled.trace}, {profiled.report}", soft_wrap=True)
    return 0


def _file(port: PortPlan, value) -> tuple[str, bytes]:
    """The file name and contents of one output; an empty output is a valid empty file."""
    if port.type in ("text", "chat"):
        return f"{port.name}.txt", ("" if value is None else str(value)).encode()
    if port.type == "audio":
        samples = torch.zeros(0) if value is None else value
        return f"{port.name}.wav", wav_bytes(samples, _rate(port))
    if port.type == "image" and value is not None:
        return f"{port.name}.png", png_bytes(value)
    if port.type == "video" and value is not None:
        return f"{port.name}.mp4", mp4_bytes(value, int(port.attrs.get("fps", DEFAULT_FPS)))
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return f"{port.name}.pt", buffer.getvalue()


def _rate(port: PortPlan) -> int:
    return int(port.attrs.get("rate", DEFAULT_RATE))


def _summary(seed: int, timeline: Timeline, audio_seconds: float) -> str:
    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"

    parts = [
        f"seed {seed}",
        f"TTFT {ms(timeline.first.get('text'))}",
        f"TTFP {ms(timeline.first.get('audio'))}",
        f"E2E {ms(timeline.ended)}",
    ]
    if audio_seconds:
        parts.append(f"RTF {timeline.ended / audio_seconds:.2f} ({audio_seconds:.2f} s of audio)")
    return " · ".join(parts) + f"  (replay: --param seed={seed})"


class _loading:
    """A progress bar over the stages whose models are loading; `on_loaded` advances it."""

    def __init__(self, plan: Plan, console: Console):
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            console=console,
            transient=True,
        )
        self.task = self.progress.add_task("loading stages", total=len(plan.stages))

    def __enter__(self):
        self.progress.start()
        return self.loaded

    def loaded(self, message: control.StartupReport) -> None:
        if isinstance(message, control.Loaded):
            self.progress.advance(self.task)
        for line in message.lines(message.about):
            self.progress.console.print(line, highlight=False)

    def __exit__(self, *exc) -> None:
        self.progress.stop()
