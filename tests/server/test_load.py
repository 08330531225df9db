"""A server with executor processes under load, faults and shutdown: auth, body limit, a
burst beyond the admission limit and its queue, 100 clients going away mid-stream, executor
crashes, draining on SIGTERM, Ctrl-C from a terminal. Nothing hangs, nothing leaks."""

import asyncio
import base64
import json
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import HERE, idle, run_async, segments_of, wait_until

KEY = "s3cret-key"
LIMIT = 100
QUEUE = 50
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
SPEECH = "/v1/audio/speech"


def ask(text: str, **extra) -> dict:
    return {"model": "probe", "messages": [{"role": "user", "content": text}], **extra}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.server.conftest import ServerProcess

    server = ServerProcess(
        [
            str(HERE / "probe.omni"),
            "--api-key",
            KEY,
            "--max-in-flight",
            str(LIMIT),
            "--max-queue",
            str(QUEUE),
            "--max-body-bytes",
            "65536",
            "--drain-timeout",
            "20",
        ]  # fmt: skip
    )
    yield server
    if server.proc.poll() is None:
        server.stop()


@pytest.fixture(scope="module")
def http(server):
    with server.client(headers=AUTH) as client:
        yield client


def inspect(http) -> dict:
    return http.get("/debug/inspect").json()["probe"]


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])


def test_the_api_key_is_required_except_on_health_and_metrics(server):
    with server.client() as anonymous:
        reply = anonymous.post(CHAT, json=ask("hi"))
        assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
        assert reply.json()["error"]["code"] == "invalid_api_key"
        wrong = anonymous.post(CHAT, json=ask("hi"), headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        basic = anonymous.post(CHAT, json=ask("hi"), headers={"Authorization": f"Basic {KEY}"})
        assert basic.status_code == 401
        assert anonymous.get("/v1/models").status_code == 401
        assert anonymous.get("/health").status_code == 200
        assert anonymous.get("/metrics").status_code == 200
        assert anonymous.post(CHAT, json=ask("hi"), headers=AUTH).status_code == 200


def test_a_body_over_the_limit_is_413(http):
    big = ask("x" * 70000)
    reply = http.post(CHAT, json=big)
    assert reply.status_code == 413 and "65536 bytes" in reply.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i : i + 8192]

    reply = http.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert reply.status_code == 413
    assert http.post(CHAT, json=ask("small")).status_code == 200


def test_a_burst_of_three_times_limit_and_queue_ends_in_200_or_503_for_each(http, server):
    rss_before = rss_kib(server.proc.pid)
    burst_size = 3 * (LIMIT + QUEUE)

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=burst_size, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.base, headers=AUTH, timeout=60,
                                     limits=limits) as client:  # fmt: skip
            return await asyncio.gather(
                *(client.post(CHAT, json=ask("wait 3")) for _ in range(burst_size))
            )

    replies = run_async(burst)
    statuses = [r.status_code for r in replies]
    assert len(statuses) == burst_size and set(statuses) <= {200, 503}
    # The limit runs, the queue waits its turn (none refused while it has room), the rest
    # are refused at once.
    assert statuses.count(200) >= LIMIT + QUEUE and statuses.count(503) >= LIMIT
    busy = next(r for r in replies if r.status_code == 503)
    assert busy.headers["retry-after"] == "1" and busy.json()["error"]["code"] == "server_busy"
    assert all(r.json()["choices"][0]["message"]["content"] == "done " for r in replies
               if r.status_code == 200)  # fmt: skip
    wait_until(lambda: idle(http, "probe"))
    assert rss_kib(server.proc.pid) < rss_before + 200 * 1024  # bounded: not per request


def test_a_hundred_clients_going_away_mid_stream_free_their_slots_within_a_second(http, server):
    async def go_away(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", CHAT, json=ask("many 100000", stream=True)) as reply:
            assert reply.status_code == 200
            async for line in reply.aiter_lines():
                if '"content": "w' in line:
                    return  # mid-stream: leaving the block closes the connection

    async def hundred() -> None:
        limits = httpx.Limits(max_connections=2 * LIMIT, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.base, headers=AUTH, timeout=60,
                                     limits=limits) as client:  # fmt: skip
            await asyncio.gather(*(go_away(client) for _ in range(LIMIT)))

    run_async(hundred)
    wait_until(lambda: idle(http, "probe"))


def test_a_client_that_gives_up_on_a_whole_reply_cancels_it(http, server):
    with server.client(headers=AUTH, timeout=0.5) as impatient, pytest.raises(httpx.ReadTimeout):
        impatient.post(CHAT, json=ask("many 100000"))
    wait_until(lambda: idle(http, "probe"))


def test_a_failing_stage_is_a_500_naming_it_and_the_server_goes_on(http):
    reply = http.post(CHAT, json=ask("please fail"))
    assert reply.status_code == 500
    assert "stage 'talk' failed: ValueError: failing as asked" in reply.json()["error"]["message"]
    assert http.post(CHAT, json=ask("fine")).status_code == 200


@pytest.fixture(scope="module")
def mouth():
    """A server of one speech pipeline of a python stage in an executor process."""
    from tests.server.conftest import ServerProcess

    server = ServerProcess([str(HERE / "mouth.omni")])
    with server.client() as client:
        yield client
    server.stop_cleanly()


def test_a_speech_stream_that_fails_midway_ends_with_an_error_event(mouth):
    """OpenAI's speech events (`stream_format: "sse"`): the audio the stage sent before it
    failed, then an error event naming it, and no `speech.audio.done`; whole, a 500 naming
    it; the next request is whole again."""
    http = mouth

    def events(text: str) -> list[dict]:
        body = {"model": "mouth", "input": text, "stream_format": "sse", "response_format": "pcm"}
        with http.stream("POST", SPEECH, json=body) as reply:
            assert reply.status_code == 200
            return [
                json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ")
            ]

    failed = events("one two fail")
    assert [e.get("type") for e in failed[:-1]] == ["speech.audio.delta"]  # the first word
    assert "stage 'mouth' failed: ValueError: failing as asked" in failed[-1]["error"]["message"]
    whole = http.post(SPEECH, json={"model": "mouth", "input": "one two fail"})
    assert whole.status_code == 500 and "failing as asked" in whole.json()["error"]["message"]
    fine = events("one two three")
    assert [e["type"] for e in fine] == [*["speech.audio.delta"] * 3, "speech.audio.done"]
    assert sum(len(base64.b64decode(e["audio"])) for e in fine[:-1]) == 3 * 240 * 2


def test_the_api_process_and_every_executor_froze_their_start_up_heaps(http):
    """What start-up made is frozen out of the garbage collector's walks (heap.py): the API
    process's (its frontend loop's entry) and each executor process's."""
    executors = inspect(http)["executors"]
    assert len(executors) >= 2  # the frontend and the probe's executor
    assert all(state["heap_frozen"] > 10_000 for state in executors.values()), executors


def test_an_executor_crash_ends_its_requests_clearly_and_the_next_succeeds(http):
    pids = set(inspect(http)["executors"])
    reply = http.post(CHAT, json=ask("crash now"))
    assert reply.status_code == 500
    assert "executor 'talk'" in reply.json()["error"]["message"]
    with http.stream("POST", CHAT, json=ask("crash again", stream=True)) as streamed:
        assert streamed.status_code == 200
        events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "died" in json.loads(events[-2])["error"]["message"]
    wait_until(lambda: http.post(CHAT, json=ask("back again")).status_code == 200, timeout=30)
    assert set(inspect(http)["executors"]) == pids
    assert http.get("/health").status_code == 200


def test_kill_9_under_load_errs_the_running_and_the_queue_drains_after_restart(http, server):
    queued = 20

    async def stream_until_killed(client: httpx.AsyncClient) -> str:
        async with client.stream("POST", CHAT, json=ask("many 100000", stream=True)) as reply:
            assert reply.status_code == 200
            events = [line[6:] async for line in reply.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return json.loads(events[-2]).get("error", {}).get("message", "")

    async def load_then_kill() -> tuple[list, list]:
        limits = httpx.Limits(max_connections=LIMIT + queued, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.base, headers=AUTH, timeout=60,
                                     limits=limits) as client:  # fmt: skip
            running = [asyncio.create_task(stream_until_killed(client)) for _ in range(LIMIT)]
            while inspect(http)["in_flight"] < LIMIT:
                await asyncio.sleep(0.05)
            waiting = [asyncio.create_task(client.post(CHAT, json=ask("after restart")))
                       for _ in range(queued)]  # fmt: skip
            while inspect(http)["queued"] < queued:
                await asyncio.sleep(0.05)
            (executor,) = server.pids() - {server.proc.pid}
            os.kill(executor, signal.SIGKILL)
            return await asyncio.gather(*running), await asyncio.gather(*waiting)

    executors = set(inspect(http)["executors"])
    errors, replies = run_async(load_then_kill)
    assert all("died" in message for message in errors), set(errors)
    assert [r.status_code for r in replies] == [200] * queued
    assert {r.json()["choices"][0]["message"]["content"] for r in replies} == {"after restart "}
    assert set(inspect(http)["executors"]) == executors  # restarted, under its own name
    wait_until(lambda: idle(http, "probe"))


def test_fuzzed_requests_kill_no_executor(http, server):
    from tests.server.fuzz import fuzz

    pids = server.pids()
    fuzz(server.base, examples=10, headers=AUTH)
    assert server.pids() == pids  # no executor died (and none was restarted)


def in_background(server, text: str) -> tuple[threading.Thread, dict]:
    """A request sent from another thread; its reply lands in the dict."""
    result = {}

    def send() -> None:
        with server.client(headers=AUTH) as client:
            result["reply"] = client.post(CHAT, json=ask(text))

    thread = threading.Thread(target=send)
    thread.start()
    return thread, result


def test_sigterm_drains_then_stops_leaving_nothing_behind(http, server):
    pids = server.pids()
    thread, result = in_background(server, "wait 2")
    wait_until(lambda: inspect(http)["in_flight"] == 1)
    server.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: http.get("/health").status_code == 503)
    refused = http.post(CHAT, json=ask("too late"))
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert refused.headers["retry-after"]
    thread.join(30)
    assert result["reply"].status_code == 200
    assert result["reply"].json()["choices"][0]["message"]["content"] == "done "
    code, err = server.stop(timeout=30)
    assert code == 0 and "Traceback" not in err
    assert segments_of(pids) == []


def test_set_serves_the_graph_with_a_stage_argument_changed(start_server):
    """`omniflow run PIPELINE --set STAGE.KEY=VALUE` compiles the graph with it: the probe's
    stage at max_batch 3 admits 3 at once (its 128 as written)."""
    server = start_server(
        str(HERE / "probe.omni"), "--mode", "inprocess", "--set", "talk.max_batch=3"
    )
    with server.client() as http:
        (model,) = http.get("/v1/models").json()["data"]
    assert model["id"] == "probe" and model["max_in_flight"] == 3


def test_set_names_its_pipeline_among_several_served(start_server):
    """Served beside others, `--set PIPELINE.STAGE.KEY=VALUE` sets that pipeline's stage
    alone; `STAGE.KEY=VALUE` every pipeline with that stage."""
    server = start_server(
        str(HERE / "probe.omni"), str(HERE / "listen.omni"), "--mode", "inprocess",
        "--set", "probe.talk.max_batch=3", "--set", "ear.max_batch=5",
    )  # fmt: skip
    with server.client() as http:
        models = {m["id"]: m["max_in_flight"] for m in http.get("/v1/models").json()["data"]}
    assert models == {"probe": 3, "listen": 5}


def test_ctrl_c_in_a_terminal_drains_with_the_executors_alive(start_server):
    server = start_server(str(HERE / "probe.omni"), env={"OMNIFLOW_API_KEY": KEY})
    pids = server.pids()
    assert len(pids) == 2  # the server and its executor
    thread, result = in_background(server, "wait 1.5")
    with server.client(headers=AUTH) as http:  # Ctrl-C once the request is in, not before
        wait_until(lambda: inspect(http)["in_flight"] == 1)
    os.killpg(server.proc.pid, signal.SIGINT)  # what Ctrl-C sends: the whole process group
    thread.join(30)
    assert result["reply"].status_code == 200
    code, err = server.stop(timeout=30)
    assert code == 0 and "Traceback" not in err and "stopped" in err
    assert segments_of(pids) == []
