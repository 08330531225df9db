"""Profiling: what the runtime recorded (runtime/events.py) as a Chrome/Perfetto trace
(trace.py), a self-contained HTML report of a trace (report.py, `omniflow profile`), the
compiler's passes drawn (viz.py, `omniflow compile --viz`), the live dashboard a server
mounts (dashboard.py), and `profile_to`, which profiles a block of work into a folder."""

from omniflow.profiler.capture import ProfileFiles, profile_to
from omniflow.profiler.dashboard import Dashboard, dashboard_html, dashboard_snapshot
from omniflow.profiler.report import render_report, write_report
from omniflow.profiler.trace import chrome_trace, write_trace

__all__ = [
    "Dashboard",
    "ProfileFiles",
    "chrome_trace",
    "dashboard_html",
    "dashboard_snapshot",
    "profile_to",
    "render_report",
    "write_report",
    "write_trace",
]
