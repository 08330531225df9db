"""`GET /metrics` (Prometheus text) and `--log-stats`: request series from the HTTP layer,
stage and edge series from `engine.inspect()`, and the runtime stats hook's series and
per-request tables."""

import json
import re
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from omniflow.server.log_stats import StatsLog
from omniflow.server.metrics import Metrics, PipelineStats
from omniflow.server.run import Timeline


@pytest.fixture(scope="module")
def http(served):
    with served.client() as client:
        yield client


def samples(text: str) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(found: dict, name: str, **labels) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


def test_request_series_count_what_happened(http):
    before = samples(http.get("/metrics").text)
    chat = {
        "model": "omni_chat",
        "messages": [{"role": "user", "content": "hi"}],
        "max_audio_tokens": 60,
        "seed": 4,
    }  # fmt: skip  (a seed whose reply has audio)
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    assert http.post("/v1/chat/completions", json={**chat, "top_p": 0.3}).status_code == 400
    after = samples(http.get("/metrics").text)

    def grew(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    endpoint = "/v1/chat/completions"
    assert grew("omniflow_requests_total", model="omni_chat", endpoint=endpoint, status="200") == 1
    assert grew("omniflow_requests_total", model="omni_chat", endpoint=endpoint, status="400") == 1
    assert (
        grew("omniflow_request_duration_seconds_count", model="omni_chat", endpoint=endpoint) == 1
    )
    for name in ("omniflow_time_to_first_token_seconds_count",
                 "omniflow_time_to_first_audio_packet_seconds_count",
                 "omniflow_real_time_factor_count"):  # fmt: skip
        assert grew(name, model="omni_chat") == 1, name
    assert grew("omniflow_audio_output_seconds_total", model="omni_chat") > 0
    assert value(after, "omniflow_requests_in_flight", model="omni_chat") == 0
    assert value(after, "omniflow_admission_limit", model="omni_chat") == 32


def test_stage_and_edge_series_come_from_the_engine(http):
    found = samples(http.get("/metrics").text)
    assert value(found, "omniflow_engine_up", model="omni_chat") == 1
    assert ("omniflow_stage_queue_depth", (("model", "omni_chat"), ("stage", "talker"))) in found
    assert value(found, "omniflow_stage_steps_total", model="omni_chat", stage="thinker") > 0
    assert (
        value(found, "omniflow_stage_batched_requests_total", model="omni_chat", stage="thinker")
        > 0
    )
    edge = "code2wav.audio->audio.in"
    assert value(found, "omniflow_edge_bytes_total", model="omni_chat", edge=edge) > 0
    assert value(found, "omniflow_edge_chunks_total", model="omni_chat", edge=edge) > 0


def test_every_series_has_help_text(http):
    text = http.get("/metrics").text
    for name in ("omniflow_stage_batch_size", "omniflow_stage_step_duration_seconds",
                 "omniflow_edge_handoff_seconds", "omniflow_ring_occupancy_ratio",
                 "omniflow_edge_put_seconds", "omniflow_stage_queue_depth"):  # fmt: skip
        assert re.search(rf"^# HELP {name}(_total)? \S", text, re.M), name


def test_the_log_stats_json_has_a_line_per_request(http, served):
    reply = http.post("/v1/chat/completions", json={"model": "probe", "messages": [
        {"role": "user", "content": "a b c"}]})  # fmt: skip
    request_id = reply.headers["x-request-id"]
    lines = [json.loads(line) for line in served.stats_path.read_text().splitlines()]
    mine = [line for line in lines if line["request_id"] == request_id]
    assert len(mine) == 1 and mine[0]["model"] == "probe" and mine[0]["status"] == 200
    assert mine[0]["e2e"]["e2e_total_tokens"] == 3 and mine[0]["e2e"]["e2e_total_ms"] > 0
    # The runtime's tables: the stage's steps and the hand-offs on both of its channels.
    talk = mine[0]["stages"]["talk"]
    assert talk["num_tokens_out"] == 3 and talk["batch_size"] >= 1 and talk["stage_gen_time_ms"] > 0
    assert set(mine[0]["edges"]) == {"prompt.out->talk.prompt", "talk.text->text.in"}
    for edge in mine[0]["edges"].values():
        assert edge["size_kbytes"] > 0 and edge["tx_time_ms"] > 0 and edge["in_flight_time_ms"] >= 0
    assert mine[0]["e2e"]["transfers_total_kbytes"] > 0


# --- the runtime's hook, in process -------------------------------------------------------
@dataclass
class StageStep:  # the shape of an event the engine may hand over as is
    stage: str
    batch_size: int
    seconds: float
    request_ids: tuple = ()
    tokens_in: int = 0
    tokens_out: int = 0


def test_the_stats_hook_feeds_histograms_and_per_request_tables():
    metrics = Metrics()
    hook = PipelineStats(metrics, "chat")
    hook(StageStep("thinker", 2, 0.004, ("r1", "r2"), tokens_out=1))
    hook.stage_step("thinker", 1, 0.002, ["r1"], tokens_out=1)
    hook.edge_transfer("thinker.text->text.in", 2048, 0.0001, "r1", in_flight_seconds=0.0002)
    found = samples(metrics.render().decode())
    assert value(found, "omniflow_stage_batch_size_count", model="chat", stage="thinker") == 2
    assert value(found, "omniflow_stage_batch_size_sum", model="chat", stage="thinker") == 3
    assert value(found, "omniflow_edge_handoff_seconds_count", model="chat",
                 edge="thinker.text->text.in") == 1  # fmt: skip
    stats = hook.take("r1")
    assert stats.stages["thinker"]["batch_size"] == 2
    assert stats.stages["thinker"]["num_tokens_out"] == 2
    assert stats.stages["thinker"]["stage_gen_time_ms"] == pytest.approx(6.0)
    assert stats.edges["thinker.text->text.in"]["size_kbytes"] == 2.0
    assert hook.take("r1").stages == {}  # taken once


def test_log_stats_prints_the_tables_and_writes_json(tmp_path):
    metrics = Metrics()
    hook = PipelineStats(metrics, "chat")
    hook.stage_step("thinker", 1, 0.002, ["r1"], tokens_in=5, tokens_out=3)
    hook.edge_transfer("a->b", 1024, 0.001, "r1")

    class Run:
        request_id, seed = "r1", 7
        served = type("S", (), {"name": "chat"})
        timeline = Timeline(began=10.0, first_text=10.1, first_audio=10.3, ended=11.0,
                            text_tokens=3, audio_samples=48000, rate=24000)  # fmt: skip

    console = Console(record=True, width=120)
    log = StatsLog(console, str(tmp_path / "stats.jsonl"))
    log.log(Run, "/v1/chat/completions", 200, hook.take("r1"))
    printed = console.export_text()
    for column in ("e2e_total_ms", "transfers_total_kbytes", "stage_gen_time_ms", "tx_time_ms"):
        assert column in printed
    record = json.loads((tmp_path / "stats.jsonl").read_text())
    assert record["e2e"]["e2e_total_ms"] == 1000.0 and record["e2e"]["rtf"] == 0.5
    assert record["e2e"]["transfers_total_kbytes"] == 1.0 and record["e2e"]["ttfp_ms"] == 300.0
    assert record["stages"]["thinker"]["num_tokens_in"] == 5
