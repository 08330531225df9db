"""What profiling costs a request, measured side by side in one run: the helpers that
`hop_overhead.py --profile` and `streaming.py --profile` share.

`interleaved` runs the same work in alternating rounds on one engine, profiled
(`engine.start_profile()` before the round, `stop_profile()` after it, outside the timed
requests) and not, with which goes first alternating too, so drift on a shared machine (other
jobs, caches, thermal) falls on both sides alike.

"Off" is a loop with no recorder: every recording site is one `recorder is not None` test.
A build with no recording sites at all cannot be had without editing the runtime, and the
difference is far below what a request's latency can resolve here, so `off_cost_ns` bounds
it instead: the sites a request passes (the events it records when profiled) times what one
such test costs, timed with `timeit`.
"""

from __future__ import annotations

import statistics
import timeit
from collections.abc import Callable

from omniflow.runtime.events import FIELDS


def interleaved(
    engine, run: Callable[[], dict[str, list[float]]], rounds: int
) -> tuple[dict[str, dict[str, list[float]]], int]:
    """`run()` (which times its own requests: metric -> samples) `rounds` times profiled and
    `rounds` times not, alternating; the samples by mode ("on", "off") and the events the
    profiled rounds recorded."""
    samples: dict[str, dict[str, list[float]]] = {"on": {}, "off": {}}
    recorded = 0
    for r in range(rounds):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            if mode == "on":
                engine.start_profile()
            for metric, values in run().items():
                samples[mode].setdefault(metric, []).extend(values)
            if mode == "on":
                recorded += sum(
                    len(p.rows) // (8 * FIELDS) + p.dropped for p in engine.stop_profile()
                )
    return samples, recorded


def off_cost_ns(sites: float) -> float:
    """An upper bound on what `sites` recording sites cost a loop that is not profiled: the
    `is not None` test each one makes, on an attribute, timed here."""

    class Loop:
        recorder = None

    loop, n = Loop(), 1_000_000
    per_test = min(timeit.repeat("loop.recorder is not None", globals={"loop": loop}, number=n))
    return sites * per_test / n * 1e9


def ratio_rows(samples: dict[str, dict[str, list[float]]]) -> list[tuple[str, float, float]]:
    """(metric, median off, median on) per metric, in seconds."""
    return [
        (metric, statistics.median(samples["off"][metric]), statistics.median(values))
        for metric, values in samples["on"].items()
    ]
