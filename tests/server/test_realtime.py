"""`WebSocket /v1/realtime` with a real WebSocket client (`websockets`) against one real
`omniflow run` server: the default omni chat on the tiny models (text and audio out), a
pipeline that hears (tests/server/listen.omni: it answers with the samples of audio and the
messages it got) and the python-stage probe (a reply that lasts until cancelled).

Sessions, text turns with their audio and usage, audio turns and the conversation's
history, cancel and barge-in, a client that goes away mid-response, mistaken events and
settings, the API key and the session's bounds; a client of today's (GA) schema, with
`websockets` and with the `openai` package's realtime client, and the beta client beside it. The executors are threads of the server
(`--mode inprocess`: it starts in seconds), as for the speech WebSocket's tests; a request
cancelled across executor processes is test_load.py's.

`test_an_audio_turn_on_the_omni_chat_graph` runs once graphs/omni_chat.omni has an audio
input (the omni-input work); until then it skips, saying so."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import numpy as np
import pytest
import soundfile
import websockets
from openai import OpenAI
from openai.types.realtime import (
    ConversationItemAdded,
    ConversationItemDone,
    ResponseAudioDeltaEvent,
    ResponseAudioTranscriptDeltaEvent,
    ResponseAudioTranscriptDoneEvent,
    ResponseDoneEvent,
    SessionCreatedEvent,
    SessionUpdatedEvent,
)

from dsl.parser import parse_file
from omniflow.catalog import load_component_config
from tests.server.conftest import GRAPHS, HERE, ServerProcess, idle, metric, run_async, wait_until

KEY = "realtime-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    server = ServerProcess(
        [str(GRAPHS / "omni_chat.omni"), str(HERE / "listen.omni"), str(HERE / "probe.omni"),
         "--tiny", "--mode", "inprocess", "--api-key", KEY,
         "--param", "omni_chat.max_tokens=8", "--param", "omni_chat.max_audio_tokens=48",
         # A greedy talker: a sampled one may end its speech at once on the tiny weights,
         # and the tests check that a turn's audio arrives.
         "--param", "omni_chat.audio_temperature=0"]
    )  # fmt: skip
    yield server
    server.stop_cleanly()


@pytest.fixture(scope="module")
def http(server):
    with server.client(headers=AUTH) as client:
        yield client


def url(server, model: str, key: str | None = KEY) -> str:
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
    assert response["status"] in ("completed", "incomplete")  # 8 tokens at most: maybe cut
    assert response["output"][0]["content"][0]["transcript"] == transcript
    # The same conversation through chat completions: the thinker is greedy, so the same text
    # and the same token counts.
    reply = http.post("/v1/chat/completions", json={
        "model": "omni_chat", "modalities": ["text"],
        "messages": [{"role": "user", "content": "Hello! Who are you?"}]}).json()  # fmt: skip
    assert reply["choices"][0]["message"]["content"] == transcript
    usage, told = reply["usage"], response["usage"]
    assert (told["total_tokens"], told["input_tokens"], told["output_tokens"]) == (
        usage["total_tokens"], usage["prompt_tokens"], usage["completion_tokens"])  # fmt: skip
    # A text prompt: no media among its tokens.
    assert told["input_token_details"] == {"text_tokens": usage["prompt_tokens"],
                                           "audio_tokens": 0, "image_tokens": 0,
                                           "video_tokens": 0}  # fmt: skip
    # The talker's codes, each `per_code` samples of the audio heard (its end token counted
    # too where it ended itself).
    per_code = load_component_config("tiny:qwen2.5-omni", "token2wav").samples_per_frame
    spoken = told["output_token_details"]
    assert spoken["text_tokens"] == told["output_tokens"]
    assert len(audio) // 2 % per_code == 0
    assert len(audio) // 2 // per_code in (spoken["audio_tokens"], spoken["audio_tokens"] - 1)
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
        await asyncio.to_thread(wait_until, lambda: idle(http, "probe"))
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
    assert cancelled["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    assert barged["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    for response in (cancelled, barged):
        assert response["status"] == "cancelled"
        assert response["output"][0]["status"] == "incomplete"
        assert response["output"][0]["content"][0]["text"].startswith("w0 ")  # as far as it got
    wait_until(lambda: idle(http, "probe"))


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

    in_flight = lambda: metric(http, "omniflow_requests_in_flight", model="probe")  # noqa: E731
    for _ in range(3):
        held, open_sessions = run_async(gone)
        assert held == 1 and open_sessions == 1
    wait_until(lambda: idle(http, "probe") and sessions() == 0 and in_flight() == 0)

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
    (json.dumps({**user_text("hi"), "previous_item_id": "nope"}), "previous_item_id", None),
    (json.dumps({"type": "conversation.item.create", "item": {"role": "robot", "content": []}}),
     "item.role", None),
    (json.dumps({"type": "response.create"}), "type", None),
    (json.dumps({"type": "response.cancel"}), "type", "response_cancel_not_active"),
    (json.dumps({"type": "response.create", "response": {"temperature": "hot"}}),
     "response.temperature", None),
    (json.dumps({"type": "response.create", "response": {"conversation": "none"}}),
     "response.conversation", "unknown_parameter"),
    # listen has no token limit to set: refused when set, named as the session's field.
    (json.dumps({"type": "session.update", "session": {"max_response_output_tokens": 5}}),
     "session.max_response_output_tokens", None),
    (json.dumps({"type": "conversation.item.delete", "item_id": "nope"}), "item_id",
     "item_not_found"),
    (json.dumps({"type": "conversation.item.delete"}), "item_id", "invalid_value"),
    (json.dumps({"type": "session.update", "session": {"modalities": [{}]}}),
     "session.modalities", None),
    ('{"deep": ' + "[" * 100000 + "]" * 100000 + ', "type": "x"}', "type", None),
    # A clip shorter than one window of the speech front end (it failed every response).
    (json.dumps({"type": "conversation.item.create", "item": {"role": "user", "content": [
        {"type": "input_audio", "audio": b64(bytes(20))}]}}), "item.content[0].audio", None),
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


def test_an_item_goes_where_its_previous_item_id_says(server):
    """OpenAI's placing: after the item named, first for "root", last without one (the id
    was ignored: every item went last)."""

    async def run():
        session = await opened(server, "listen")
        previous = []
        for text, after in (("a", None), ("b", "root"), ("c", "a"), ("d", None)):
            event = {**user_text(text), "previous_item_id": after} if after else user_text(text)
            event["item"]["id"] = text
            await session.send_event(event)
            created, _ = await session.until("conversation.item.created")
            previous.append(created["previous_item_id"])
        await session.ws.close()
        return previous

    # The conversation runs b, a, c, d.
    assert run_async(run) == [None, None, "a", "c"]


def test_settings_are_checked_when_set_and_named_as_the_clients_fields(server):
    """A setting the pipeline refuses is an error at session.update (never stored, so it
    cannot fail every later response), named `session.X`; a response's override
    `response.X`; null puts a setting back to its default."""

    async def run():
        session = await opened(server, "omni_chat")
        answers = []
        for update in ({"voice": "Nobody"}, {"max_response_output_tokens": 100000},
                       {"temperature": 500}, {"voice": "ethan", "temperature": 0.5},
                       {"voice": None, "temperature": None}):  # fmt: skip
            await session.send("session.update", session=update)
            answers.append(json.loads(await session.ws.recv()))
        await session.send_event(user_text("hi"))
        await session.until("conversation.item.created")
        await session.send("response.create", response={"voice": "Nobody"})
        override = json.loads(await session.ws.recv())
        await session.ws.close()
        return answers, override

    (voice, tokens, temperature, good, reset), override = run_async(run)
    assert voice["error"]["param"] == "session.voice" and "Nobody" in voice["error"]["message"]
    assert tokens["error"]["param"] == "session.max_response_output_tokens"
    assert temperature["error"]["param"] == "session.temperature"
    assert good["type"] == "session.updated" and good["session"]["temperature"] == 0.5
    assert good["session"]["max_response_output_tokens"] == "inf"  # the refused one: not kept
    assert reset["session"]["voice"] is None and reset["session"]["temperature"] is None
    assert override["type"] == "error" and override["error"]["param"] == "response.voice"


def test_the_api_key_is_required(server):
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
        await session.send("response.create")  # its reply would have no place
        no_room, _ = await session.until("error")
        first = next(e for e in seen if e["type"] == "conversation.item.created")
        await session.send("conversation.item.delete", item_id=first["item"]["id"])
        deleted, _ = await session.until("conversation.item.deleted")
        await session.send_event(user_text("room again"))
        again, _ = await session.until("conversation.item.created")
        # A frame over the server's WebSocket limit (16 MiB) closes the socket: 1009.
        await session.ws.send("x" * (16 << 20 | 1))
        with pytest.raises(websockets.ConnectionClosedError):
            await session.ws.recv()
        return (full["error"], large["error"], items["error"], no_room["error"], seen,
                deleted["item_id"] == first["item"]["id"], again, session.ws.close_code)  # fmt: skip

    full, large, items, no_room, seen, deleted, again, code = run_async(run)
    assert full["code"] == "buffer_full" and full["param"] == "audio"
    assert large["code"] == "too_large"
    assert items["code"] == "conversation_full"
    assert no_room["code"] == "conversation_full"
    assert sum(e["type"] == "conversation.item.created" for e in seen) == 64
    assert deleted and again["item"]["content"][0]["text"] == "room again"
    assert code == 1009


def omni_chat_hears() -> bool:
    return any(i.type == "audio" for i in parse_file(GRAPHS / "omni_chat.omni").inputs)


@pytest.mark.skipif(not omni_chat_hears(), reason="graphs/omni_chat.omni takes no audio yet")
def test_an_audio_turn_on_the_omni_chat_graph(server, http):
    """Spoken turns on the default omni graph once it hears (the omni-input work): the
    committed buffer reaches the thinker as the same request a chat completion with that
    clip as `input_audio` makes (the same text and token counts), and a second spoken turn
    answers the conversation so far."""
    clip = pcm16(0.5)
    wav = io.BytesIO()
    soundfile.write(wav, np.frombuffer(clip, "<i2"), 16000, format="WAV", subtype="PCM_16")

    async def run():
        session = await opened(server, "omni_chat")
        await session.send("session.update", session={"modalities": ["text"]})
        await session.until("session.updated")
        dones = []
        for _ in range(2):
            await session.send("input_audio_buffer.append", audio=b64(clip))
            await session.send("input_audio_buffer.commit")
            await session.until("input_audio_buffer.committed")
            await session.send("response.create")
            done, events = await session.until("response.done")
            assert "error" not in [e["type"] for e in events], events
            dones.append(done["response"])
        await session.ws.close()
        return dones

    one, two = run_async(run)
    content = [{"type": "input_audio", "input_audio": {"data": b64(wav.getvalue()),
                                                       "format": "wav"}}]  # fmt: skip
    reply = http.post("/v1/chat/completions", json={
        "model": "omni_chat", "modalities": ["text"],
        "messages": [{"role": "user", "content": content}]}).json()  # fmt: skip
    assert one["output"][0]["content"][0]["text"] == reply["choices"][0]["message"]["content"]
    assert one["usage"]["input_tokens"] == reply["usage"]["prompt_tokens"]
    assert one["usage"]["output_tokens"] == reply["usage"]["completion_tokens"]
    assert two["status"] in ("completed", "incomplete")
    assert two["usage"]["input_tokens"] > one["usage"]["input_tokens"]  # the history too


# Today's (GA) schema: the settings nested and renamed, the events renamed.
GA_SESSION = {
    "type": "realtime",
    "output_modalities": ["audio"],
    "instructions": "Be brief.",
    "audio": {
        "input": {"format": {"type": "audio/pcm", "rate": 16000}, "turn_detection": None},
        "output": {"voice": "ethan", "format": {"type": "audio/pcm", "rate": 24000}},
    },
}
BETA_EVENTS = {"conversation.item.created", "response.text.delta", "response.text.done",
               "response.audio.delta", "response.audio.done",
               "response.audio_transcript.delta", "response.audio_transcript.done"}  # fmt: skip


def chat_reply(http, text: str, max_tokens: int, instructions: str | None = None) -> dict:
    """The same conversation through chat completions (the thinker is greedy: the same text
    and token counts as a realtime response)."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    return http.post("/v1/chat/completions", json={
        "model": "omni_chat", "modalities": ["text"], "max_tokens": max_tokens,
        "messages": [*messages, {"role": "user", "content": text}]}).json()  # fmt: skip


def test_a_ga_client_is_answered_in_todays_schema(server, http):
    async def run():
        session = await opened(server, "omni_chat")
        await session.send("session.update", session=GA_SESSION)
        updated, _ = await session.until("session.updated")
        await session.send_event(user_text("Hello! Who are you?"))
        item_done, before = await session.until("conversation.item.done")
        await session.send("response.create", response={"max_output_tokens": 3})
        done, events = await session.until("response.done")
        await session.ws.close()
        return updated["session"], before, item_done, done["response"], events

    settings, before, item_done, response, events = run_async(run)
    assert settings["type"] == "realtime" and settings["output_modalities"] == ["audio"]
    assert settings["audio"]["output"] == GA_SESSION["audio"]["output"]
    assert settings["audio"]["input"] == GA_SESSION["audio"]["input"]
    assert settings["max_output_tokens"] == "inf" and settings["instructions"] == "Be brief."
    assert not {"voice", "modalities", "max_response_output_tokens"} & set(settings)
    # GA splits conversation.item.created into .added and .done, the same item.
    assert [e["type"] for e in before] == ["conversation.item.added"]
    assert before[0]["item"] == item_done["item"] and item_done["item"]["role"] == "user"
    kinds = [e["type"] for e in events]
    assert not BETA_EVENTS & set(kinds) and "error" not in kinds, kinds
    assert {"response.output_audio_transcript.delta", "response.output_audio.delta",
            "response.output_audio.done", "response.output_audio_transcript.done"} <= set(kinds)  # fmt: skip
    transcript = "".join(e["delta"] for e in events
                         if e["type"] == "response.output_audio_transcript.delta")  # fmt: skip
    (part,) = response["output"][0]["content"]
    assert part == {"type": "output_audio", "transcript": transcript}
    reply = chat_reply(http, "Hello! Who are you?", 3, instructions="Be brief.")
    assert transcript == reply["choices"][0]["message"]["content"]  # max_output_tokens held
    assert response["usage"]["output_tokens"] == reply["usage"]["completion_tokens"]
    expected = "incomplete" if reply["choices"][0]["finish_reason"] == "length" else "completed"
    assert response["status"] == expected


def test_a_beta_session_takes_todays_names_and_is_answered_in_them_from_then_on(server):
    """The issue's client: configured in beta names, then a `response.create` with
    `max_output_tokens`. The same response asked in beta names in a second session: the same
    text and usage, in beta events."""

    async def ask(response: dict):
        session = await opened(server, "omni_chat")
        await session.send("session.update", session={"voice": "ethan"})
        updated, _ = await session.until("session.updated")
        await session.send_event(user_text("Hello! Who are you?"))
        created, _ = await session.until("conversation.item.created")
        await session.send("response.create", response=response)
        done, events = await session.until("response.done")
        await session.ws.close()
        return updated["session"], done["response"], [e["type"] for e in events]

    async def run():
        beta = await ask({"modalities": ["text"], "max_response_output_tokens": 2})
        ga = await ask({"output_modalities": ["text"], "max_output_tokens": 2})
        return beta, ga

    (beta_settings, beta, beta_kinds), (ga_settings, ga, ga_kinds) = run_async(run)
    assert beta_settings["voice"] == ga_settings["voice"] == "ethan"  # beta until then
    assert "response.text.delta" in beta_kinds and "response.text.done" in beta_kinds
    assert "response.output_text.delta" in ga_kinds and "response.output_text.done" in ga_kinds
    assert not BETA_EVENTS & set(ga_kinds) and "error" not in beta_kinds + ga_kinds
    assert beta["output"][0]["content"][0]["type"] == "text"
    assert ga["output"][0]["content"][0]["type"] == "output_text"
    assert beta["output"][0]["content"][0]["text"] == ga["output"][0]["content"][0]["text"]
    assert beta["usage"] == ga["usage"] and ga["usage"]["output_tokens"] <= 2


GA_MISTAKES = [
    ({"type": "transcription"}, "session.type", None),
    ({"audio": {"output": {"voice": "Nobody"}}}, "session.audio.output.voice", None),
    ({"max_output_tokens": 100000}, "session.max_output_tokens", None),
    ({"max_output_tokens": "lots"}, "session.max_output_tokens", None),
    ({"output_modalities": ["video"]}, "session.output_modalities", None),
    ({"audio": {"input": {"format": {"type": "audio/pcmu"}}}}, "session.audio.input.format", None),
    ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 8000}}}},
     "session.audio.input.format", None),
    ({"audio": {"input": {"transcription": {"model": "whisper-1"}}}},
     "session.audio.input.transcription", "unknown_parameter"),
    ({"audio": "loud"}, "session.audio", None),
    ({"voice": "ethan", "audio": {"output": {"voice": "ethan"}}}, "session.audio.output.voice",
     None),
    ({"tools": []}, "session.tools", "unknown_parameter"),
]  # fmt: skip


def test_a_ga_clients_mistakes_are_named_by_todays_fields(server):
    async def run():
        session = await opened(server, "omni_chat")
        await session.send("session.update", session={"type": "realtime"})
        await session.until("session.updated")
        errors = []
        for update, _, _ in GA_MISTAKES:
            await session.send("session.update", session=update)
            error, seen = await session.until("error")
            assert not seen
            errors.append(error["error"])
        await session.send_event(user_text("hi"))
        await session.until("conversation.item.done")
        for response in ({"audio": {"output": {"voice": "Nobody"}}},
                         {"audio": {"input": {"format": {"type": "audio/pcm"}}}}):  # fmt: skip
            await session.send("response.create", response=response)
            error, _ = await session.until("error")
            errors.append(error["error"])
        await session.send("session.update", session={"instructions": "fine"})
        updated, _ = await session.until("session.updated")
        await session.ws.close()
        return errors, updated["session"]

    errors, settings = run_async(run)
    expected = [*GA_MISTAKES, (None, "response.audio.output.voice", None),
                (None, "response.audio.input", "unknown_parameter")]  # fmt: skip
    for error, (update, param, code) in zip(errors, expected, strict=True):
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param, (update, error)
        assert f"'{param}'" in error["message"], error  # the message names it as sent
        if code:
            assert error["code"] == code
    assert "output_modalities" in errors[-3]["message"]  # what a session takes, in GA names
    assert "Nobody" in errors[1]["message"]
    # Nothing a mistake carried was kept.
    assert settings["audio"]["output"]["voice"] is None and settings["max_output_tokens"] == "inf"
    assert settings["instructions"] == "fine"


def test_the_openai_packages_realtime_client_speaks_with_the_server(server, http):
    """The `openai` package's own realtime client (the GA one) against the local server: every
    event it receives parses as that schema's type."""
    client = OpenAI(base_url=server.url, api_key=KEY)
    with client.realtime.connect(model="omni_chat") as connection:
        created = connection.recv()
        connection.session.update(session={"type": "realtime", "output_modalities": ["audio"],
                                           "audio": {"output": {"voice": "ethan"}}})  # fmt: skip
        updated = connection.recv()
        connection.conversation.item.create(item={
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "Hello! Who are you?"}]})  # fmt: skip
        connection.response.create(response={"max_output_tokens": 3})
        events = [connection.recv()]
        while not isinstance(events[-1], ResponseDoneEvent):
            events.append(connection.recv())

    assert isinstance(created, SessionCreatedEvent) and created.session.type == "realtime"
    assert isinstance(updated, SessionUpdatedEvent)
    assert updated.session.audio.output.voice == "ethan"
    assert updated.session.audio.output.format.rate == 24000
    assert [type(e) for e in events[:2]] == [ConversationItemAdded, ConversationItemDone]
    transcript = "".join(
        e.delta for e in events if isinstance(e, ResponseAudioTranscriptDeltaEvent)
    )
    (said,) = [e for e in events if isinstance(e, ResponseAudioTranscriptDoneEvent)]
    assert said.transcript == transcript
    assert any(isinstance(e, ResponseAudioDeltaEvent) and e.delta for e in events)
    response = events[-1].response
    assert response.output[0].content[0].type == "output_audio"
    assert response.output[0].content[0].transcript == transcript
    reply = chat_reply(http, "Hello! Who are you?", 3)
    assert transcript == reply["choices"][0]["message"]["content"]
    assert response.usage.output_tokens == reply["usage"]["completion_tokens"]
