"""Per-request counters of one program loop, kept while the engine asked for request stats
(the server's `--log-stats`): per stage, the batch sizes a request shared, the steps it took
in and gave out and the time its steps took; per channel, the bytes it sent, the time
putting them took, the time taking them took and how long they were in flight.

When every stage of the loop is done with a request, its tables go to the engine
(`control.RequestStats`); the frontend's loop, which has no stages, hands them over when
the engine asks (`take`). Off, a loop has no tallies and pays one `is None` test per site.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from omniflow.runtime import control


@dataclass
class _Tally:
    stages: dict[str, dict[str, float]] = field(default_factory=dict)
    edges: dict[str, dict[str, float]] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)

    def row(self, table: dict, name: str) -> dict[str, float]:
        return table.setdefault(name, {})


def _add(row: dict[str, float], key: str, value: float) -> None:
    row[key] = row.get(key, 0) + value


class Tallies:
    def __init__(self, stages: list[str], report: Callable[[control.RequestStats], None]):
        self.stages = set(stages)
        self.report = report
        self.requests: dict[str, _Tally] = {}

    def _of(self, request_id: str) -> _Tally:
        tally = self.requests.get(request_id)
        if tally is None:
            tally = self.requests[request_id] = _Tally()
        return tally

    def step(self, stage: str, request_ids: list[str], seconds: float, out: list[int]) -> None:
        for request_id, steps in zip(request_ids, out, strict=True):
            tally = self._of(request_id)
            row = tally.row(tally.stages, stage)
            row["batch_size"] = max(row.get("batch_size", 0), len(request_ids))
            _add(row, "num_tokens_out", steps)
            _add(row, "stage_gen_time_ms", seconds * 1e3)

    def counted(self, request_id: str, stage: str, counters: dict[str, int]) -> None:
        """What a backend counted for the request in a step (`Call.counters`)."""
        tally = self._of(request_id)
        row = tally.row(tally.stages, stage)
        for key, value in counters.items():
            _add(row, key, value)

    def fed(self, request_id: str, stage: str, steps: int) -> None:
        tally = self._of(request_id)
        _add(tally.row(tally.stages, stage), "num_tokens_in", steps)

    def sent(self, request_id: str, edge: str, nbytes: int, seconds: float) -> None:
        tally = self._of(request_id)
        row = tally.row(tally.edges, edge)
        _add(row, "size_kbytes", nbytes / 1024)
        _add(row, "tx_time_ms", seconds * 1e3)

    def received(self, request_id: str, edge: str, seconds: float, in_flight: float) -> None:
        tally = self._of(request_id)
        row = tally.row(tally.edges, edge)
        _add(row, "rx_decode_time_ms", seconds * 1e3)
        _add(row, "in_flight_time_ms", in_flight * 1e3)

    def ended(self, request_id: str, stage: str) -> None:
        """`stage` is done with the request; once every stage here is, its tables go out."""
        tally = self._of(request_id)
        tally.done.add(stage)
        if self.stages and tally.done >= self.stages:
            del self.requests[request_id]
            self.report(control.RequestStats(request_id, tally.stages, tally.edges))

    def take(self, request_id: str) -> control.RequestStats:
        tally = self.requests.pop(request_id, None) or _Tally()
        return control.RequestStats(request_id, tally.stages, tally.edges)

    def drop(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
