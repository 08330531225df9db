"""`GET /metrics` (Prometheus text) and `--log-stats`: request series from the HTTP layer,
stage and edge series (their histograms included) from `engine.inspect()`, and the
per-request tables the engine hands to the stats hook."""

import json
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from omniflow.runtime.control import RequestStats
from omniflow.server.log_stats import StatsLog
from omniflow.server.metrics import PipelineStats
from omniflow.server.run import Timeline
from tests.server.conftest import idle, wait_until


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
    assert (
        http.post("/v1/chat/completions", json={**chat, "presence_penalty": 0.3}).status_code == 400
    )
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
    thinker = {"model": "omni_chat", "stage": "thinker"}
    assert value(found, "omniflow_stage_gen_time_seconds_count", **thinker) > 0
    assert value(found, "omniflow_stage_batch_size_sum", **thinker) > 0
    edge = "code2wav.audio->audio.in"
    assert value(found, "omniflow_edge_bytes_total", model="omni_chat", edge=edge) > 0
    assert value(found, "omniflow_edge_chunks_total", model="omni_chat", edge=edge) > 0


def test_a_chat_asking_for_text_alone_runs_no_talker_and_no_vocoder(http):
    """`modalities: ["text"]` admits the request for the text output alone: the thinker
    steps for it, the talker and code2wav never see it."""
    wait_until(lambda: idle(http, "omni_chat"))
    before = samples(http.get("/metrics").text)
    chat = {"model": "omni_chat", "messages": [{"role": "user", "content": "hi"}],
            "modalities": ["text"], "max_tokens": 6}  # fmt: skip
    reply = http.post("/v1/chat/completions", json=chat)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]
    after = samples(http.get("/metrics").text)
    steps = {
        stage: value(after, "omniflow_stage_batch_size_count", model="omni_chat", stage=stage)
        - value(before, "omniflow_stage_batch_size_count", model="omni_chat", stage=stage)
        for stage in ("thinker", "talker", "code2wav")
    }
    assert steps["thinker"] > 0 and steps["talker"] == steps["code2wav"] == 0, steps


def histogram(found: dict, name: str, **labels) -> dict[str, float]:
    """A histogram's cumulative buckets by `le`, with its `count` and `sum`."""
    out = {
        "count": value(found, f"{name}_count", **labels),
        "sum": value(found, f"{name}_sum", **labels),
    }
    for (sample, pairs), v in found.items():
        kept = dict(pairs)
        le = kept.pop("le", None)
        if sample == f"{name}_bucket" and kept == labels:
            out[le] = v
    return out


def test_step_and_hand_off_histograms_grow_with_the_requests(http):
    """Requests one at a time: every step of `talk` has a batch of one, each chunk on an edge
    is counted once by its producer (chunks) and once by its consumer (hand-off times)."""
    before = samples(http.get("/metrics").text)
    requests = 3
    for _ in range(requests):
        reply = http.post("/v1/chat/completions", json={"model": "probe", "messages": [
            {"role": "user", "content": "a b c"}]})  # fmt: skip
        assert reply.status_code == 200
    after = samples(http.get("/metrics").text)

    def grew(name: str, **labels) -> dict[str, float]:
        now, then = histogram(after, name, **labels), histogram(before, name, **labels)
        return {key: v - then.get(key, 0.0) for key, v in now.items()}

    talk = {"model": "probe", "stage": "talk"}
    batch, gen = (
        grew("omniflow_stage_batch_size", **talk),
        grew("omniflow_stage_gen_time_seconds", **talk),
    )
    assert batch["count"] >= 3 * requests  # a word per step
    assert gen["count"] == batch["count"] == batch["+Inf"] == gen["+Inf"]
    assert batch["1.0"] == batch["count"] and batch["sum"] == batch["count"]
    assert gen["sum"] > 0
    for edge in ("prompt.out->talk.prompt", "talk.text->text.in"):
        handoff = grew("omniflow_edge_in_flight_time_seconds", model="probe", edge=edge)
        chunks = value(after, "omniflow_edge_chunks_total", model="probe", edge=edge) - value(
            before, "omniflow_edge_chunks_total", model="probe", edge=edge
        )
        assert handoff["count"] == handoff["+Inf"] == chunks >= requests, edge
        assert handoff["sum"] > 0, edge
    for buckets in (histogram(after, "omniflow_stage_gen_time_seconds", **talk),
                    histogram(after, "omniflow_edge_in_flight_time_seconds", model="probe",
                              edge="talk.text->text.in")):  # fmt: skip
        cumulative = [v for key, v in buckets.items() if key not in ("count", "sum")]
        assert cumulative == sorted(cumulative) and len(cumulative) > 5


def test_every_series_has_help_text(http):
    text = http.get("/metrics").text
    for name in ("omniflow_stage_batch_size", "omniflow_stage_gen_time_seconds",
                 "omniflow_edge_in_flight_time_seconds", "omniflow_ring_occupancy_ratio",
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


# --- the per-request tables, in process ----------------------------------------------------
def test_the_stats_hook_keeps_each_request_s_tables_until_taken():
    hook = PipelineStats()
    hook(RequestStats("r1", {"thinker": {"batch_size": 2}}, {}))
    hook(RequestStats("r1", {}, {"thinker.text->text.in": {"size_kbytes": 2.0}}))  # 2nd executor
    stats = hook.take("r1")
    assert stats.stages == {"thinker": {"batch_size": 2}}
    assert stats.edges["thinker.text->text.in"]["size_kbytes"] == 2.0
    assert hook.take("r1").stages == {}  # taken once


def test_log_stats_prints_the_tables_and_writes_json(tmp_path):
    hook = PipelineStats()
    stage = {"batch_size": 1, "num_tokens_in": 5, "num_tokens_out": 3, "stage_gen_time_ms": 2.0}
    hook(RequestStats("r1", {"thinker": stage}, {"a->b": {"size_kbytes": 1.0, "tx_time_ms": 1.0}}))

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
