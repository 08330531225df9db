"""`--log-stats`: after each request, the per-request tables vllm-omni's users know, printed
with rich (`--log-stats`) and/or appended as one JSON line (`--log-stats-json FILE`):

- e2e: `e2e_total_ms`, `e2e_total_tokens`, `transfers_total_time_ms`,
  `transfers_total_kbytes` (plus TTFT, TTFP and RTF where the request had them);
- per stage: `batch_size`, `num_tokens_in`, `num_tokens_out`, `stage_gen_time_ms`,
  `postprocess_time_ms`, and what its backend counted (a denoiser's `steps_computed` and
  `steps_reused`: step caching);
- per edge: `size_kbytes`, `tx_time_ms`, `rx_decode_time_ms`, `in_flight_time_ms`.

The stage and edge tables come from the engines, started with `on_stats` for this
(`PipelineStats`); a request they reported nothing for prints its e2e row only.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from omniflow.server.metrics import RequestStats

STAGE_COLUMNS = (
    "batch_size", "num_tokens_in", "num_tokens_out", "stage_gen_time_ms", "postprocess_time_ms",
)  # fmt: skip
# Counted by some backends only (a denoiser's step cache): a column when a request has them.
COUNTER_COLUMNS = ("steps_computed", "steps_reused")
EDGE_COLUMNS = ("size_kbytes", "tx_time_ms", "rx_decode_time_ms", "in_flight_time_ms")


def e2e_row(run, stats: RequestStats) -> dict:
    timeline = run.timeline
    row = {
        "e2e_total_ms": _ms(timeline.ended - timeline.began),
        "e2e_queue_ms": _ms(timeline.queued),
        "e2e_total_tokens": sum(s.get("num_tokens_out", 0) for s in stats.stages.values())
        or timeline.text_tokens,
    }
    if stats.edges:
        row["transfers_total_time_ms"] = round(
            sum(e.get("tx_time_ms", 0.0) for e in stats.edges.values()), 3
        )
        row["transfers_total_kbytes"] = round(
            sum(e.get("size_kbytes", 0.0) for e in stats.edges.values()), 3
        )
    else:
        row["transfers_total_time_ms"] = row["transfers_total_kbytes"] = None
    if (ttft := timeline.seconds(timeline.first_text)) is not None:
        row["ttft_ms"] = _ms(ttft)
    if (ttfp := timeline.seconds(timeline.first_audio)) is not None:
        row["ttfp_ms"] = _ms(ttfp)
    if timeline.audio_seconds:
        row["audio_s"] = round(timeline.audio_seconds, 3)
        row["rtf"] = round((timeline.ended - timeline.began) / timeline.audio_seconds, 4)
        row["underrun_s"] = round(timeline.playback.underrun, 3)
    return row


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


class StatsLog:
    def __init__(self, console: Console | None, json_path: str | None):
        self.console = console
        self.json_path = Path(json_path) if json_path else None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.console is not None or self.json_path is not None

    def log(self, run, endpoint: str, status: int, stats: RequestStats) -> None:
        e2e = e2e_row(run, stats)
        record = {
            "request_id": run.request_id,
            "model": run.served.name,
            "endpoint": endpoint,
            "status": status,
            "seed": run.seed,
            "e2e": e2e,
            "stages": stats.stages,
            "edges": stats.edges,
        }
        with self._lock:
            if self.json_path is not None:
                with self.json_path.open("a", encoding="utf-8") as out:
                    out.write(json.dumps(record) + "\n")
            if self.console is not None:
                self._print(record)

    def _print(self, record: dict) -> None:
        self.console.print(
            f"{record['request_id']} · {record['model']} · {record['endpoint']} · "
            f"{record['status']} · seed {record['seed']}",
            soft_wrap=True,
        )
        e2e = _table(None, "e2e", ["value"])
        for key, value in record["e2e"].items():
            e2e.add_row(key, _cell(value))
        self.console.print(e2e)
        counted = [c for c in COUNTER_COLUMNS if any(c in r for r in record["stages"].values())]
        for name, columns, rows in (
            ("stage", STAGE_COLUMNS + tuple(counted), record["stages"]),
            ("edge", EDGE_COLUMNS, record["edges"]),
        ):
            if rows:
                table = _table(None, name, list(columns))
                for key, row in rows.items():
                    table.add_row(key, *(_cell(row.get(c)) for c in columns))
                self.console.print(table)


def _table(title: str | None, first: str, columns: list[str]) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", show_edge=False)
    table.add_column(first, no_wrap=True)
    for column in columns:
        table.add_column(column, justify="right")
    return table


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".")
    return str(value)
