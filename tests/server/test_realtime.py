"""`WebSocket /v1/realtime` with a real WebSocket client (`websockets`) against the suite's
shared `omniflow run` server: the default omni chat on the tiny models (text and audio
out), a pipeline that hears (tests/server/listen.omni: it answers with the samples of audio
and the messages it got) and the python-stage probe (a reply that lasts until cancelled).

Sessions, text turns with their audio and usage, audio turns and the conversation's
history, cancel and barge-in, a client that goes away mid-response, mistaken events, the API
key and the session's bounds."""

from __future__ import annotations

import asyncio
import base64
import json
import re

import numpy as np
import pytest
import torch
import websockets

from omniflow.media import audio_bytes
from tests.server.conftest import HERE, run_async, wait_until

KEY = "realtime-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(served):
    """The shared server (every example pipeline on the tiny models, probe and listen)."""
    return served


@pytest.fixture(scope="module")
def http(server):
    with server.client() as client:
        yield client


def url(server, model: str, key: str | None = None) -> str:
    base = server.base.replace("http://", "ws://")
    return f"{base}/v1/realtime?model={model}" + (f"&api_key={key}" if key else "")


def pcm16(seconds: float, rate: int = 16000) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    return (np.sin(2 * np.pi * 220 * t) * 8000).astype("<i2").tobytes()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def user_text(text: str) -> dict:
    return {"type": "conversation.item.create",
            "item": {"type": "message", "role": "user",
                     "content": [{"type": "input_text", "text": text}]}}  # fmt: skip


class Session:
    """A client's side of one session: send events, read them until one of a type."""

    def __init__(self, ws):
        self.ws = ws

    async def send(self, kind: str, **fields) -> None:
        await self.ws.send(json.dumps({"type": kind, **fields}))

    async def send_event(self, event: dict) -> None:
        await self.ws.send(json.dumps(event))

    async def until(self, kind: str, timeout: float = 60) -> tuple[dict, list[dict]]:
        """The first event of `kind`, and every event before it."""
        seen = []
        async with asyncio.timeout(timeout):
            while True:
                event = json.loads(await self.ws.recv())
                if event["type"] == kind:
                    return event, seen
                seen.append(event)


async def opened(server, model: str) -> Session:
    session = Session(await websockets.connect(url(server, model), max_size=None))
    created, _ = await session.until("session.created")
    assert created["session"]["model"] == model
    return session


def metric(http, name: str, **labels) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in http.get("/metrics").text.splitlines():
        match = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if match and ",".join(sorted(match.group(1).split(","))) == wanted:
            return float(match.group(2))
    return 0.0


def idle(http, model: str) -> bool:
    state = http.get("/debug/inspect").json()[model]
    calls = [c for e in state["executors"].values() for c in e["calls"].values()]
    return state["in_flight"] == 0 and not any(calls)


def test_a_session_starts_with_the_pipelines_modalities_and_rates(server):
    async def run():
        chat = Session(await websockets.connect(url(server, "omni_chat")))
        listen = Session(await websockets.connect(url(server, "listen")))
        first = (await chat.until("session.created"))[0]["session"]
        second = (await listen.until("session.created"))[0]["session"]
        await chat.ws.close()
        await listen.ws.close()
        return first, second

    chat, listen = run_async(run)
    assert chat["modalities"] == ["text", "audio"] and listen["modalities"] == ["text"]
    assert chat["output_audio_rate"] == 24000 and chat["input_audio_rate"] == 16000
    assert chat["input_audio_format"] == chat["output_audio_format"] == "pcm16"
    assert chat["id"] != listen["id"]


def test_a_text_turn_streams_its_transcript_and_audio_and_reports_true_usage(server, http):
    # Alone on the thinker, as the chat request below will be: a step batched with another
    # request's rows may pick another token on the tiny random weights.
    wait_until(lambda: idle(http, "omni_chat"), timeout=30)

    async def run():
        session = await opened(server, "omni_chat")
        await session.send_event(user_text("Hello! Who are you?"))
        created, _ = await session.until("conversation.item.created")
        await session.send("response.create")
        done, events = await session.until("response.done")
        await session.ws.close()
        return created, done, events

    created, done, events = run_async(run)
    assert created["item"]["role"] == "user"
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and "error" not in kinds
    transcript = "".join(
        e["delta"] for e in events if e["type"] == "response.audio_transcript.delta"
    )
    audio = b"".join(base64.b64decode(e["delta"]) for e in events
                     if e["type"] == "response.audio.delta")  # fmt: skip
    assert transcript and len(audio) > 0 and len(audio) % 2 == 0
    (said,) = [e for e in events if e["type"] == "response.audio_transcript.done"]
    assert said["transcript"] == transcript
    response = done["response"]
    assert response["status"] in ("completed", "incomplete")  # 6 tokens at most: maybe cut
    assert response["output"][0]["content"][0]["transcript"] == transcript
    # The same conversation through chat completions: the thinker is greedy, so the same text
    # and the same token counts.
    wait_until(lambda: idle(http, "omni_chat"), timeout=30)
    reply = http.post("/v1/chat/completions", json={
        "model": "omni_chat", "modalities": ["text"],
        "messages": [{"role": "user", "content": "Hello! Who are you?"}]}).json()  # fmt: skip
    assert reply["choices"][0]["message"]["content"] == transcript, (events, reply)
    usage = reply["usage"]
    assert response["usage"] == {"total_tokens": usage["total_tokens"],
                                 "input_tokens": usage["prompt_tokens"],
                                 "output_tokens": usage["completion_tokens"]}  # fmt: skip
    expected = "incomplete" if reply["choices"][0]["finish_reason"] == "length" else "completed"
    assert response["status"] == expected


def test_audio_turns_reach_the_pipeline_with_the_conversation_so_far(server):
    first, second = pcm16(0.5), pcm16(0.25)

    async def run():
        session = await opened(server, "listen")
        await session.send("session.update", session={"instructions": "Be brief."})
        await session.until("session.updated")
        for half in (first[: len(first) // 2], first[len(first) // 2 :]):
            await session.send("input_audio_buffer.append", audio=b64(half))
        await session.send("input_audio_buffer.commit")
        committed, _ = await session.until("input_audio_buffer.committed")
        await session.send("response.create")
        one, _ = await session.until("response.done")
        await session.send("input_audio_buffer.append", audio=b64(second))
        await session.send("input_audio_buffer.commit")
        await session.send("response.create")
        two, _ = await session.until("response.done")
        await session.ws.close()
        return committed, one, two

    committed, one, two = run_async(run)
    assert committed["item_id"] and committed["previous_item_id"] is None
    text = lambda done: done["response"]["output"][0]["content"][0]["text"]  # noqa: E731
    # System instructions + the user's audio; then the instructions, the assistant's answer
    # and the newest audio (the pipeline takes one clip a request: the earlier turn is in the
    # conversation through the reply to it).
    assert text(one) == f"heard {len(first) // 2} samples, 2 messages"
    assert text(two) == f"heard {len(second) // 2} samples, 3 messages"
    assert one["response"]["status"] == two["response"]["status"] == "completed"


def test_a_spoken_turn_reaches_omni_chats_thinker_as_its_chat_request_does(server, http):
    clip = pcm16(0.6)

    async def run():
        session = await opened(server, "omni_chat")
        await session.send("session.update", session={"modalities": ["text"]})
        await session.send("input_audio_buffer.append", audio=b64(clip))
        await session.send("input_audio_buffer.commit")
        await session.send("response.create")
        done, events = await session.until("response.done")
        await session.ws.close()
        return done["response"], events

    wait_until(lambda: idle(http, "omni_chat"), timeout=30)
    response, events = run_async(run)
    assert "error" not in [e["type"] for e in events]
    wait_until(lambda: idle(http, "omni_chat"), timeout=30)
    heard = response["output"][0]["content"][0]["text"]
    wav = audio_bytes(torch.frombuffer(bytearray(clip), dtype=torch.int16), 16000, "wav")
    part = {"type": "input_audio", "input_audio": {"data": b64(wav), "format": "wav"}}
    reply = http.post("/v1/chat/completions", json={"model": "omni_chat", "modalities": ["text"],
                      "messages": [{"role": "user", "content": [part]}]}).json()  # fmt: skip
    assert heard == reply["choices"][0]["message"]["content"]
    assert response["usage"]["input_tokens"] == reply["usage"]["prompt_tokens"]
    text_only = http.post("/v1/chat/completions", json={"model": "omni_chat", "modalities": ["text"],
                          "messages": [{"role": "user", "content": ""}]}).json()  # fmt: skip
    assert response["usage"]["input_tokens"] > text_only["usage"]["prompt_tokens"]  # it heard


def test_audio_on_a_pipeline_that_does_not_hear_is_an_error_naming_it(server):
    async def run():
        session = await opened(server, "probe")
        await session.send("input_audio_buffer.append", audio=b64(pcm16(0.1)))
        await session.send("input_audio_buffer.commit")
        error, _ = await session.until("error")
        part = {"type": "input_audio", "audio": b64(pcm16(0.1))}
        await session.send_event({"type": "conversation.item.create",
                                  "item": {"role": "user", "content": [part]}})  # fmt: skip
        second, _ = await session.until("error")
        await session.send_event(user_text("one two"))  # the session goes on
        await session.send("response.create")
        done, _ = await session.until("response.done")
        await session.ws.close()
        return error["error"], second["error"], done

    commit, item, done = run_async(run)
    assert commit["param"] == "input_audio_buffer" and "takes no audio input" in commit["message"]
    assert item["param"] == "item.content[0]" and item["code"] == "audio_not_supported"
    assert done["response"]["output"][0]["content"][0]["text"] == "one two "


def test_cancel_and_barge_in_end_the_response_in_every_stage(server, http):
    async def run():
        session = await opened(server, "probe")
        await session.send_event(user_text("many 100000"))
        await session.send("response.create")
        await session.until("response.text.delta")
        await session.send("response.cancel")
        cancelled, _ = await session.until("response.done")
        await asyncio.to_thread(wait_until, lambda: idle(http, "probe"), 5)
        # Barge-in: with turn detection on, the user's audio cancels the reply.
        await session.send("session.update", session={"turn_detection": {"type": "server_vad"}})
        await session.send_event(user_text("many 100000"))
        await session.send("response.create")
        await session.until("response.text.delta")
        await session.send("input_audio_buffer.append", audio=b64(pcm16(0.05)))
        barged, _ = await session.until("response.done")
        await session.ws.close()
        return cancelled["response"], barged["response"]

    cancelled, barged = run_async(run)
    for response in (cancelled, barged):
        assert response["status"] == "cancelled"
        assert response["status_details"]["type"] == "cancelled"
        assert response["output"][0]["status"] == "incomplete"
        assert response["output"][0]["content"][0]["text"].startswith("w0 ")  # as far as it got
    wait_until(lambda: idle(http, "probe"), timeout=5)


def test_a_client_gone_mid_response_frees_everything_and_the_next_session_works(server, http):
    sessions = lambda: metric(  # noqa: E731
        http, "omniflow_websocket_sessions", model="probe", endpoint="/v1/realtime"
    )

    async def gone():
        session = await opened(server, "probe")
        await session.send_event(user_text("many 100000"))
        await session.send("response.create")
        await session.until("response.text.delta")
        held = http.get("/debug/inspect").json()["probe"]["in_flight"], sessions()
        session.ws.transport.abort()  # no close frame
        return held

    for _ in range(3):
        in_flight, open_sessions = run_async(gone)
        assert in_flight == 1 and open_sessions == 1
    wait_until(lambda: idle(http, "probe") and sessions() == 0, timeout=5)

    async def next_one():
        session = await opened(server, "probe")
        await session.send_event(user_text("still here"))
        await session.send("response.create")
        done, _ = await session.until("response.done")
        await session.ws.close()
        return done["response"]

    assert run_async(next_one)["output"][0]["content"][0]["text"] == "still here "


MISTAKES = [
    ("not json", "type", None),
    (json.dumps({"no": "type"}), "type", None),
    (json.dumps({"type": "response.explode"}), "type", None),
    (json.dumps({"type": "session.update", "session": {"tools": []}}), "session.tools",
     "unknown_parameter"),
    (json.dumps({"type": "session.update", "session": {"modalities": ["audio"]}}),
     "session.modalities", None),
    (json.dumps({"type": "session.update", "session": {"input_audio_format": "g711_ulaw"}}),
     "session.input_audio_format", None),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "%%%"}), "audio", None),
    (json.dumps({"type": "input_audio_buffer.append", "audio": b64(b"abc")}), "audio", None),
    (json.dumps({"type": "input_audio_buffer.commit"}), "type", "input_audio_buffer_empty"),
    (json.dumps({"type": "conversation.item.create", "item": {"role": "robot", "content": []}}),
     "item.role", None),
    (json.dumps({"type": "response.create"}), "type", None),
    (json.dumps({"type": "response.cancel"}), "type", "response_cancel_not_active"),
    (json.dumps({"type": "response.create", "response": {"temperature": "hot"}}),
     "response.temperature", None),
]  # fmt: skip


def test_each_mistaken_event_is_an_error_event_and_the_session_goes_on(server):
    async def run():
        session = await opened(server, "listen")
        errors = []
        for i, (text, _, _) in enumerate(MISTAKES):
            if text.startswith('{"type"'):  # the client's event id comes back with its error
                text = json.dumps({**json.loads(text), "event_id": f"client-{i}"})
            await session.ws.send(text)
            error, seen = await session.until("error")
            assert not seen
            errors.append(error)
        await session.send("session.update", session={"instructions": "fine"})
        updated, _ = await session.until("session.updated")
        await session.ws.close()
        return errors, updated

    errors, updated = run_async(run)
    for error, (text, param, code) in zip(errors, MISTAKES, strict=True):
        assert error["error"]["type"] == "invalid_request_error"
        assert error["error"]["param"] == param, (text, error)
        if code:
            assert error["error"]["code"] == code
        assert "Traceback" not in error["error"]["message"]
    assert [e["error"].get("event_id") for e in errors] == [
        f"client-{i}" if text.startswith('{"type"') else None
        for i, (text, _, _) in enumerate(MISTAKES)
    ]
    assert updated["session"]["instructions"] == "fine"


def test_the_api_key_is_required(start_server):
    server = start_server(str(HERE / "probe.omni"), "--api-key", KEY)

    async def run():
        refused = []
        for key in (None, "wrong"):
            with pytest.raises(websockets.InvalidStatus) as info:
                await websockets.connect(url(server, "probe", key))
            refused.append(info.value.response.status_code)  # closed before the handshake
        ws = await websockets.connect(url(server, "probe", None), additional_headers=AUTH)
        created = json.loads(await ws.recv())
        await ws.close()
        return refused, created

    refused, created = run_async(run)
    assert refused == [403, 403] and created["type"] == "session.created"


def test_what_a_session_holds_is_bounded(server):
    async def run():
        session = await opened(server, "listen")
        megabyte = b64(bytes(1 << 20))
        for _ in range(4):  # 4 MiB: the buffer's bound
            await session.send("input_audio_buffer.append", audio=megabyte)
        await session.send("input_audio_buffer.append", audio=b64(bytes(2)))
        full, _ = await session.until("error")
        await session.ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": "A" * (5 << 20)}))  # fmt: skip
        large, _ = await session.until("error")
        await session.send("input_audio_buffer.clear")
        await session.until("input_audio_buffer.cleared")
        for i in range(64):
            await session.send_event(user_text(f"item {i}"))
        await session.send_event(user_text("one too many"))
        items, seen = await session.until("error")
        await session.ws.close()
        return full["error"], large["error"], items["error"], seen

    full, large, items, seen = run_async(run)
    assert full["code"] == "buffer_full" and full["param"] == "audio"
    assert large["code"] == "too_large"
    assert items["code"] == "conversation_full"
    assert sum(e["type"] == "conversation.item.created" for e in seen) == 64
