"""Profile a block of work into a folder: `trace.json` (Chrome trace, the plan inside) and
`report.html` (`omniflow profile`'s report of it).

    with profile_to("prof", engine) as files:
        engine.generate(...)
    print(files.report)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from omniflow.profiler.report import write_report
from omniflow.profiler.trace import chrome_trace

TRACE_FILE, REPORT_FILE = "trace.json", "report.html"


@dataclass
class ProfileFiles:
    """Where the profile goes; `events` is filled in when the block ends."""

    trace: Path
    report: Path | None
    events: int = 0


@contextmanager
def profile_to(
    directory: str | Path,
    engine,
    *,
    capacity: int = 1 << 16,
    report: bool = True,
    gpu: bool = False,
) -> Iterator[ProfileFiles]:
    """Record every executor's events (up to `capacity` each, the oldest overwritten beyond;
    with `gpu`, the GPU stages' CUDA kernels too) while the block runs; then write the trace
    and, with `report`, the report into `directory` (made if missing). A block that raises
    still leaves its trace."""
    directory = Path(directory)
    files = ProfileFiles(directory / TRACE_FILE, directory / REPORT_FILE if report else None)
    engine.start_profile(capacity, gpu)
    try:
        yield files
    except BaseException:
        with suppress(Exception):  # the block's error is the one to see
            _write(engine, files)
        raise
    _write(engine, files)


def _write(engine, files: ProfileFiles) -> None:
    trace = chrome_trace(engine.stop_profile(), engine.plan)
    files.trace.parent.mkdir(parents=True, exist_ok=True)
    files.trace.write_text(json.dumps(trace), encoding="utf-8")
    files.events = sum(1 for e in trace["traceEvents"] if e["ph"] != "M")
    if files.report is not None:
        write_report(trace, files.report)
