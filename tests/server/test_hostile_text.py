"""Hostile and careless text against the server (issue 41: text, sockets, process lifetime).

First every parser and segmenter a client's text goes through, at the size limit (64 KiB of
adversarial text: dots, spaces, newlines, no terminator, alternating punctuation, brackets):
each finishes in well under a second, and the speech segmenter still cuts ordinary text as
its rule says. Then each hostile request replayed against real `omniflow run` servers:

- one serving graphs/qwen3_tts.omni and graphs/omni_chat.omni on the tiny models (executors
  as threads: it starts in seconds), with an API key, `--access-log` and small realtime
  caps, its temp dir its own: every refusal is a 4xx or an `error` event within a second,
  `/health` answers while the hostile request is in flight, the server's memory stays
  bounded, no traceback reaches its log, and after it stops nothing is left in /dev/shm or
  its temp dir;
- one serving graphs/qwen3_tts.omni with executor processes: a client that gives up on a
  long speech request stops its talker, and SIGKILL of the server leaves no executor, no
  shared memory and no log folder behind.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import getpass
import io
import json
import os
import random
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import websockets
from PIL import Image

from omniflow.compiler import compile_file
from omniflow.runtime.prompts import PromptLimit, PromptTooLong, prompt_limits
from omniflow.runtime.requests import RequestError, admit
from omniflow.server import speech_stream
from omniflow.server.errors import APIError, public
from omniflow.server.params import parse_form_value
from omniflow.server.protocol import parse_json
from omniflow.server.run import StopScanner
from omniflow.server.sockets import client_message
from omniflow.server.speech_stream import MAX_BUFFER_CHARS, MAX_SEGMENT_CHARS, Segmenter
from tests.server.conftest import (
    GRAPHS,
    ServerProcess,
    alive,
    idle,
    metric,
    run_async,
    segments_of,
    wait_until,
)

LIMIT = 64 << 10  # the size limit of a piece of text: what a speech session holds
FAST_S = 1.0  # a refusal comes within this: generous, on a loaded 2-core machine
RSS_GROWTH_KIB = 64 << 10  # what one hostile request may add to the server's memory, at most
KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SPEECH = "/v1/audio/speech"
CHAT = "/v1/chat/completions"
# A speech request that lasts: seed 5 speaks this for 330 frames (26 s of audio).
LONG_SPEECH = {"input": "A very long one.", "voice": "Ryan", "max_new_tokens": 2000, "seed": 5}


def png_uri(side: int = 8) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


PNG = png_uri()


def sized(pattern: str, size: int = LIMIT) -> str:
    return (pattern * (size // len(pattern) + 1))[:size]


ADVERSARIAL = {
    "dots": sized("."),
    "spaces": sized(" "),
    "newlines": sized("\n"),
    "no terminator": sized("x"),
    "dot space": sized(". "),
    "dot letter": sized(".x"),
    "alternating punctuation": sized(".!?;…,:"),
    "closers after marks": sized(".)\"']"),
    "space then dots": " " + sized(".", LIMIT - 1),
    "cjk marks": sized("。！"),
    "brackets": sized("["),
    "reprs": sized("<a at 0x1 "),
    # (JSON-escaped as surrogate pairs, 12 characters each: the lone-surrogate check walks)
    "emoji": sized("😀", LIMIT // 2),
}


def timed(work, *args):
    began = time.perf_counter()
    result = work(*args)
    return result, time.perf_counter() - began


# --- the segmenter and the parsers at the size limit --------------------------------------------


# The segmenting rule, written the slow obvious way: a sentence ends where this regex's first
# match ends (if within MAX_SEGMENT_CHARS); else, past MAX_SEGMENT_CHARS, at the last white
# space within them (else there).
_SENTENCE = re.compile(r"[.!?;…]+[\"')\]]*(?=\s)|[。！？；]+|\n")


def segments_by_the_rule(pieces: list[str]) -> tuple[list[str], str]:
    text, out = "", []
    for piece in pieces:
        text += piece
        while True:
            match = _SENTENCE.search(text)
            if match is not None and match.end() <= MAX_SEGMENT_CHARS:
                cut = match.end()
            elif len(text) > MAX_SEGMENT_CHARS:
                spaces = [m.end() for m in re.finditer(r"\s", text[:MAX_SEGMENT_CHARS])]
                cut = spaces[-1] if spaces else MAX_SEGMENT_CHARS
            else:
                break
            out.append(text[:cut].strip())
            text = text[cut:]
    return [s for s in out if s], text


def segmented(pieces: list[str]) -> tuple[list[str], str]:
    segmenter = Segmenter()
    out = [s for piece in pieces for s in segmenter.add(piece)]
    return out, segmenter.text


def test_the_segmenter_cuts_as_its_rule_says_however_the_text_arrives():
    rng = random.Random(41)
    marks = list("ab .!?;…\"')],:、，：。！？；\n\t\u3000")
    for _ in range(1500):
        n = rng.randint(0, 700)
        alphabet = marks if rng.random() < 0.5 else list("aaaa bbb. ")
        text = "".join(rng.choice(alphabet) for _ in range(n))
        cuts = sorted(rng.sample(range(n + 1), min(n + 1, rng.randint(0, 8))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, n], strict=True)]
        assert segmented(pieces) == segments_by_the_rule(pieces), pieces


def test_the_segmenter_on_ordinary_text():
    pieces = ["Hello ", "there. How ", "are", " you today? And", " goodbye"]
    assert segmented(pieces) == (["Hello there.", "How are you today?"], " And goodbye")
    assert segmented(["“Quoted.” Next! 你好。再见\nLast line"]) == (
        ["“Quoted.” Next!", "你好。", "再见"],
        "Last line",
    )
    words = " ".join(["word"] * 100) + "."  # one sentence of 500 characters
    segments, rest = segmented([words + " "])
    assert all(len(s) <= MAX_SEGMENT_CHARS for s in segments) and rest == " "
    assert " ".join(segments) == words


@pytest.mark.parametrize("name", ADVERSARIAL)
def test_the_segmenter_is_fast_at_the_size_limit(name):
    text = ADVERSARIAL[name]
    (whole, rest), seconds = timed(segmented, [text])
    assert seconds < FAST_S, f"{seconds:.2f} s"
    assert "".join(whole + [rest]).replace(" ", "") == "".join(text.split())  # nothing lost
    pieces = [text[i : i + 7] for i in range(0, len(text), 7)]  # as a client streams it
    (in_pieces, _), seconds = timed(segmented, pieces)
    assert seconds < FAST_S, f"{seconds:.2f} s in pieces"
    assert len(in_pieces) >= len(whole) - 1


@pytest.mark.parametrize("name", ADVERSARIAL)
def test_the_json_parsers_are_fast_at_the_size_limit(name):
    text = ADVERSARIAL[name]
    frame = {"type": "websocket.receive", "text": json.dumps({"type": "input.text", "text": text})}
    message, seconds = timed(client_message, frame, speech_stream.MAX_MESSAGE_CHARS)
    assert message["text"] == text and seconds < FAST_S
    body, seconds = timed(parse_json, json.dumps({"input": text}).encode())
    assert body["input"] == text and seconds < FAST_S
    for parse in (
        lambda: client_message({"text": text}, speech_stream.MAX_MESSAGE_CHARS),
        lambda: parse_json(text.encode()),
        lambda: parse_form_value("lora", text, dict),
    ):
        began = time.perf_counter()
        with pytest.raises(APIError) as refused:
            parse()
        assert refused.value.status == 400 and time.perf_counter() - began < FAST_S


def test_json_nested_past_the_parsers_depth_is_a_400():
    deep = "[" * 100000
    for parse, says in (
        (lambda: client_message({"text": deep}, len(deep)), "nested too deeply"),
        (lambda: parse_json(deep.encode()), "the body is JSON nested too deeply"),
        (lambda: parse_form_value("lora", deep, dict), "must be a JSON dict"),
    ):
        with pytest.raises(APIError) as refused:
            parse()
        assert refused.value.status == 400 and says in refused.value.message


@pytest.mark.parametrize("name", ADVERSARIAL)
def test_stop_strings_are_scanned_fast_at_the_size_limit(name):
    """A stop string as long as the text holds all of it back, chunk after chunk; each chunk
    is searched once, not the whole held text again."""
    text = ADVERSARIAL[name]
    scanner = StopScanner([text + "!", "never!"])
    began = time.perf_counter()
    out = [scanner.feed(text[i : i + 3]) for i in range(0, len(text), 3)]
    assert time.perf_counter() - began < FAST_S
    assert "".join(piece for piece, _ in out) + scanner.flush() == text
    assert not any(stopped for _, stopped in out)
    scanner = StopScanner([text + "!", "never!"])
    assert scanner.feed(text) == ("", False) and scanner.feed("never!") == (text, True)


@pytest.mark.parametrize("name", ADVERSARIAL)
def test_error_text_is_cleaned_fast_at_the_size_limit(name):
    cleaned, seconds = timed(public, ADVERSARIAL[name])
    assert seconds < FAST_S and " at 0x" not in cleaned and len(cleaned) < 4200


def test_an_objects_address_never_reaches_an_error():
    err = APIError(
        400, "not an image file: cannot identify image file <_io.BytesIO object at 0x7f3b2c>"
    )
    assert err.message.endswith("<_io.BytesIO object>")
    assert "0x" not in json.dumps(err.body())


@pytest.fixture(scope="module")
def limits():
    """The prompt limits of the graphs the servers below serve, and graphs/tts.omni's (its
    checkpoint keeps the tokenizer in its talker's folder), on the tiny models (omni chat's
    towers have media limits beside its thinker's)."""
    found = {}
    for name in ("qwen3_tts", "omni_chat", "tts"):
        plan = compile_file(str(GRAPHS / f"{name}.omni"), tiny=True)
        (limit,) = [limit for limit in prompt_limits(plan) if isinstance(limit, PromptLimit)]
        found[name] = (plan, limit)
    return found


@pytest.mark.parametrize("name", ADVERSARIAL)
def test_prompts_are_counted_fast_at_the_size_limit(limits, name):
    """Tokenizers and the chat template on each text: counted (or refused untokenized, or
    by the size of the plan's buffer for a chat) within the bound."""
    text = ADVERSARIAL[name]
    tts, chat = limits["qwen3_tts"], limits["omni_chat"]
    for (plan, limit), inputs in (
        (tts, {"text": text}),
        (limits["tts"], {"text": text}),
        (tts, {"text": "Hi.", "instructions": text, "ref_text": text}),
        (
            chat,
            {
                "prompt": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": text},
                ]
            },
        ),
    ):
        began = time.perf_counter()
        with pytest.raises(RequestError):  # 64 KiB is past every tiny max_len
            limit.check(admit(plan, inputs))
        assert time.perf_counter() - began < FAST_S


def test_every_text_of_the_talkers_prompt_counts_and_the_largest_is_named(limits):
    plan, tts = limits["qwen3_tts"]
    fits = admit(plan, {"text": "Hello there.", "instructions": "Speak softly."})
    tts.check(fits)
    for field in ("instructions", "ref_text"):
        request = admit(plan, {"text": "hi " * 1000, field: "word " * 3500})
        with pytest.raises(PromptTooLong) as refused:
            tts.check(request)
        assert refused.value.field == field, str(refused.value)
        assert "at most 4096 tokens (max_len)" in str(refused.value)
    # Ten megabytes, which the tiny tokenizer takes seconds to tokenize (a megabyte: ~0.7 s
    # on a 2-core machine), so a bound generous on a loaded machine still tells them apart.
    huge = admit(plan, {"text": "hi", "instructions": "x" * 10_000_000})
    began = time.perf_counter()
    with pytest.raises(PromptTooLong, match="at least 500000 tokens"):
        tts.check(huge)  # refused by its size alone: the text is never tokenized
    assert time.perf_counter() - began < FAST_S


# --- a server under attack -----------------------------------------------------------------------


class Attacked:
    """A server whose output is read as it comes (an attack must not fill its pipes), in a
    temp dir of its own."""

    def __init__(self, args: list[str], tmp: Path):
        self.tmp = tmp
        self.server = ServerProcess(args, env={"TMPDIR": str(tmp)})
        self.base = self.server.base
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.readers = [
            threading.Thread(target=self._read, args=(pipe, lines), daemon=True)
            for pipe, lines in ((self.server.proc.stdout, self.stdout),
                                (self.server.proc.stderr, self.stderr))
        ]  # fmt: skip
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(pipe, lines: list[str]) -> None:
        for line in pipe:
            lines.append(line)

    @property
    def pid(self) -> int:
        return self.server.proc.pid

    def rss_kib(self) -> int:
        status = Path(f"/proc/{self.pid}/status").read_text()
        return int(next(s for s in status.splitlines() if s.startswith("VmRSS")).split()[1])

    def ws(self, path: str) -> str:
        return self.base.replace("http://", "ws://") + path

    def stop(self) -> int:
        pids = self.server.pids()
        self.server.proc.send_signal(signal.SIGTERM)
        code = self.server.proc.wait(timeout=60)
        for reader in self.readers:
            reader.join(10)
        wait_until(lambda: not any(map(alive, pids)))
        assert segments_of(pids) == []
        return code


def leftovers(tmp: Path) -> set[str]:
    """What a server left in its temp dir, but torch's compile cache (`torchinductor_USER`,
    which transformers' import makes once per user and every run shares)."""
    return set(os.listdir(tmp)) - {f"torchinductor_{getpass.getuser()}"}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tmpdir")
    attacked = Attacked(
        [str(GRAPHS / "qwen3_tts.omni"), str(GRAPHS / "omni_chat.omni"), "--tiny",
         "--mode", "inprocess", "--api-key", KEY, "--access-log",
         "--param", "max_tokens=6", "--param", "omni_chat.max_audio_tokens=48",
         "--max-realtime-sessions", "2", "--max-realtime-text", "65536",
         "--realtime-idle-timeout", "3", "--max-speech-sessions", "2",
         "--speech-idle-timeout", "3"],
        tmp,
    )  # fmt: skip
    yield attacked
    assert attacked.stop() == 0, "".join(attacked.stderr)
    log = "".join(attacked.stderr)
    assert "Traceback" not in log, log
    assert leftovers(tmp) == set()


@pytest.fixture(scope="module")
def http(target):
    with httpx.Client(base_url=target.base, headers=AUTH, timeout=60) as client:
        yield client


@dataclass
class Outcome:
    result: object
    seconds: float
    slowest_health: float
    rss_growth_kib: int

    def assert_harmless(self, within: float = FAST_S) -> None:
        """Answered within `within`, /health answering meanwhile, memory bounded."""
        assert self.seconds < within, f"{self.seconds:.2f} s"
        assert self.slowest_health < 2 * FAST_S, f"/health took {self.slowest_health:.2f} s"
        assert self.rss_growth_kib < RSS_GROWTH_KIB, f"+{self.rss_growth_kib} KiB"


def under_attack(target: Attacked, attack) -> Outcome:
    """Run `attack()` (a coroutine function) while /health is asked every 20 ms: its
    result, how long it took, the slowest /health answer meanwhile, the memory it added."""

    async def run() -> Outcome:
        rss = target.rss_kib()
        slowest, done = 0.0, asyncio.Event()
        async with httpx.AsyncClient(base_url=target.base, timeout=30) as client:

            async def ping() -> None:
                nonlocal slowest
                while not done.is_set():
                    began = time.perf_counter()
                    assert (await client.get("/health")).status_code == 200
                    slowest = max(slowest, time.perf_counter() - began)
                    await asyncio.sleep(0.02)

            pinger = asyncio.ensure_future(ping())
            began = time.perf_counter()
            try:
                result = await attack()
            finally:
                seconds = time.perf_counter() - began
                done.set()
                await pinger
        return Outcome(result, seconds, slowest, target.rss_kib() - rss)

    return run_async(run)


def error_of(reply: httpx.Response, status: int = 400) -> dict:
    assert reply.status_code == status, reply.text
    return reply.json()["error"]


def talker_steps(http) -> int:
    executors = http.get("/debug/inspect").json()["qwen3_tts"]["executors"]
    return next(e["stages"]["talker"][0] for e in executors.values() if "talker" in e["stages"])


# --- HTTP: every text of a prompt counts ----------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "Hi.", "instructions": "x" * 1_000_000}, "instructions"),
        ({"input": "Hi.", "instructions": "word " * 5000, "voice": "Ryan"}, "instructions"),
        ({"input": "word " * 5000}, "input"),
    ],
)
def test_each_text_of_a_speech_prompt_counts_at_admission(target, http, body, param):
    steps = talker_steps(http)

    async def attack() -> httpx.Response:
        async with httpx.AsyncClient(base_url=target.base, headers=AUTH, timeout=60) as client:
            return await client.post(SPEECH, json={"model": "qwen3_tts", **body})

    outcome = under_attack(target, attack)
    error = error_of(outcome.result)
    assert error["param"] == param and error["code"] == "context_length_exceeded", error
    assert "at most 4096 tokens (max_len)" in error["message"]
    outcome.assert_harmless()
    assert talker_steps(http) == steps  # refused before any stage ran


@pytest.mark.parametrize(
    "content",
    [
        "x" * 1_000_000,
        [{"type": "text", "text": "word " * 5000}],
        [{"type": "text", "text": "word " * 5000},
         {"type": "image_url", "image_url": {"url": PNG}}],
    ],
    ids=["text", "text part", "text part and image"],
)  # fmt: skip
def test_every_chat_message_counts_at_admission(target, content):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]

    async def attack() -> httpx.Response:
        async with httpx.AsyncClient(base_url=target.base, headers=AUTH, timeout=60) as client:
            return await client.post(CHAT, json={"model": "omni_chat", "messages": messages})

    outcome = under_attack(target, attack)
    error = error_of(outcome.result)
    assert error["param"].startswith("messages"), error
    assert "0x" not in error["message"]
    outcome.assert_harmless()


def test_a_deeply_nested_body_is_a_400(target):
    async def attack() -> httpx.Response:
        async with httpx.AsyncClient(base_url=target.base, headers=AUTH, timeout=60) as client:
            return await client.post(
                SPEECH, content=b"[" * 100000, headers={"content-type": "application/json"}
            )

    outcome = under_attack(target, attack)
    assert error_of(outcome.result)["code"] == "invalid_json"
    outcome.assert_harmless()


LONE_SURROGATE = '"\\ud800 hi"'  # a JSON string no UTF-8 text can hold


@pytest.mark.parametrize(
    "path, body, param",
    [
        (CHAT, '{"model": "omni_chat", "messages": [{"role": "user", "content": %s}]}',
         "messages[0].content"),
        (SPEECH, '{"model": "qwen3_tts", "input": "Hi.", "instructions": %s}', "instructions"),
    ],
    ids=["chat", "speech"],
)  # fmt: skip
def test_a_lone_surrogate_is_a_400_naming_its_field(target, path, body, param):
    async def attack() -> httpx.Response:
        async with httpx.AsyncClient(base_url=target.base, headers=AUTH, timeout=60) as client:
            raw = (body % LONE_SURROGATE).encode()
            return await client.post(
                path, content=raw, headers={"content-type": "application/json"}
            )

    outcome = under_attack(target, attack)
    error = error_of(outcome.result)
    assert error["param"] == param and "lone surrogate" in error["message"], error
    outcome.assert_harmless()


def test_an_unreadable_image_names_no_object_address(http):
    url = "data:image/png;base64," + base64.b64encode(b"not a png").decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]  # fmt: skip
    error = error_of(http.post(CHAT, json={"model": "omni_chat", "messages": messages}))
    assert "image" in error["message"] and " at 0x" not in error["message"], error


def test_health_names_the_models_only_to_key_holders(target, http):
    anonymous = httpx.get(target.base + "/health")
    assert anonymous.status_code == 200 and anonymous.json() == {"status": "ok"}
    assert http.get("/health").json() == {"status": "ok", "models": ["qwen3_tts", "omni_chat"]}
    wrong = httpx.get(target.base + "/health", headers={"Authorization": "Bearer nope"})
    assert "models" not in wrong.json()


def test_the_access_log_has_a_line_per_request(target, http):
    http.get("/v1/models")
    wait_until(lambda: any('"GET /v1/models HTTP/1.1" 200' in line for line in target.stdout))


# --- the speech WebSocket -------------------------------------------------------------------------


async def speech_session(target: Attacked, frames: list[str]) -> tuple[list[dict], int]:
    """Send `frames`, then read the session's control messages until the server closes it;
    those messages, and the close code."""
    messages = []
    async with websockets.connect(target.ws(speech_stream.PATH), additional_headers=AUTH,
                                  max_size=None) as ws:  # fmt: skip
        try:
            for frame in frames:
                await ws.send(frame)
            async for frame in ws:
                if isinstance(frame, str):
                    messages.append(json.loads(frame))
        except websockets.ConnectionClosedError:
            pass  # a close code other than 1000: the caller checks it
        return messages, ws.close_code


def start_frame(**fields) -> str:
    return json.dumps({"type": "session.start", "voice": "Ryan", **fields})


def text_frame(text: str) -> str:
    return json.dumps({"type": "input.text", "text": text})


@pytest.mark.parametrize(
    "frames, code, says",
    [
        ([start_frame(), "[" * 100000], "invalid_request_error", "nested too deeply"),
        ([start_frame(), text_frame("." * (MAX_BUFFER_CHARS + 1))], "too_much_text",
         "at most 65536"),
        ([start_frame(), *[text_frame("a. " * 21000)] * 3], "too_much_text", "segments wait"),
        ([start_frame(), *[text_frame("x" * 1000)] * 80], "too_much_text", "characters wait"),
        ([start_frame(), "x" * (speech_stream.MAX_MESSAGE_CHARS + 1)], "too_large", "at most"),
        ([start_frame(instructions="word " * 5000)], "context_length_exceeded",
         "at most 4096 tokens"),
        ([start_frame(), f'{{"type": "input.text", "text": {LONE_SURROGATE}}}'],
         "invalid_request_error", "lone surrogate"),
    ],
    ids=["nested", "over the text bound", "tiny sentences", "many messages", "huge frame",
         "long instructions", "lone surrogate"],
)  # fmt: skip
def test_a_hostile_speech_session_gets_an_error_event_and_a_close(target, http, frames, code, says):
    outcome = under_attack(target, lambda: speech_session(target, frames))
    messages, close = outcome.result
    errors = [m["error"] for m in messages if m["type"] == "error"]
    assert len(errors) == 1 and close == 1008, messages
    assert code in (errors[0]["code"], errors[0]["type"]) and says in errors[0]["message"]
    outcome.assert_harmless(within=5 * FAST_S)  # the pieces before the refusal are sent too
    wait_until(lambda: idle(http, "qwen3_tts"))


def test_a_long_run_of_dots_is_spoken_without_stalling_the_server(target, http):
    """The issue's 12000 dots: segments of dots start at once, /health answers throughout,
    and cancel stops them."""

    async def attack():
        async with websockets.connect(target.ws(speech_stream.PATH), additional_headers=AUTH,
                                      max_size=None) as ws:  # fmt: skip
            await ws.send(json.dumps({"type": "session.start", "voice": "Ryan"}))
            await ws.recv()
            await ws.send(text_frame("." * 12000))
            started = json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "cancel"}))
            while (frame := await ws.recv()) and (
                isinstance(frame, bytes) or json.loads(frame)["type"] != "cancelled"
            ):
                pass
            return started, json.loads(frame)

    outcome = under_attack(target, attack)
    started, cancelled = outcome.result
    assert started["type"] == "segment.started" and started["text"] == "." * MAX_SEGMENT_CHARS
    assert cancelled["segments"][0] == 0
    outcome.assert_harmless(within=10 * FAST_S)
    wait_until(lambda: idle(http, "qwen3_tts"))


def check_capped_and_idle(
    http, model: str, path: str, connect, opened, opened_type: str, flag: str
) -> None:
    """With a cap of 2 sessions of `path` and a 3 s idle timeout: a third session is refused
    (`server_busy`, 1013, naming `flag`), an idle one is closed (`session_expired`, 1000),
    and then there is room again. `connect()` opens a socket, `opened(ws)` is the message
    that says its session is open (of type `opened_type`)."""
    sessions = lambda: metric(  # noqa: E731
        http, "omniflow_websocket_sessions", model=model, endpoint=path
    )
    wait_until(lambda: sessions() == 0)  # the sessions of the tests before have ended

    async def run():
        first, second = await connect(), await connect()
        for ws in (first, second):
            assert (await opened(ws))["type"] == opened_type
        third = await connect()
        refused = json.loads(await third.recv())
        with pytest.raises(websockets.ConnectionClosed):
            await third.recv()
        await second.close()
        began = time.monotonic()
        expired = json.loads(await first.recv())  # idle: nothing sent, nothing running
        idle_for = time.monotonic() - began
        with pytest.raises(websockets.ConnectionClosed):
            await first.recv()
        fourth = await connect()  # room again
        again = await opened(fourth)
        await fourth.close()
        return refused, third.close_code, expired, first.close_code, idle_for, again

    refused, refused_code, expired, expired_code, idle_for, again = run_async(run)
    assert refused["type"] == "error" and refused["error"]["code"] == "server_busy"
    assert flag in refused["error"]["message"] and refused_code == 1013
    assert expired["error"]["code"] == "session_expired" and expired_code == 1000
    assert idle_for < 10  # the 3 s idle timeout, generously
    assert again["type"] == opened_type


def test_speech_sessions_are_capped_and_an_idle_one_is_closed(target, http):
    async def started(ws) -> dict:
        await ws.send(start_frame())
        return json.loads(await ws.recv())

    check_capped_and_idle(
        http,
        "qwen3_tts",
        speech_stream.PATH,
        lambda: websockets.connect(target.ws(speech_stream.PATH), additional_headers=AUTH),
        started,
        "session.started",
        "--max-speech-sessions",
    )


# --- realtime sessions ----------------------------------------------------------------------------


def realtime_url(target: Attacked) -> str:
    return target.ws(f"/v1/realtime?model=omni_chat&api_key={KEY}")


async def realtime_replies(ws, events: list[dict | str]) -> list[dict]:
    """Send each event; the server's answer to each (the next event it sends)."""
    answers = []
    for event in events:
        await ws.send(event if isinstance(event, str) else json.dumps(event))
        answers.append(json.loads(await ws.recv()))
    return answers


def user_item(text: str) -> dict:
    return {"type": "conversation.item.create",
            "item": {"type": "message", "role": "user",
                     "content": [{"type": "input_text", "text": text}]}}  # fmt: skip


def test_a_hostile_realtime_event_is_an_error_and_the_session_goes_on(target):
    async def attack():
        async with websockets.connect(realtime_url(target), max_size=None) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            answers = await realtime_replies(ws, [
                "[" * 100000,
                {"type": "session.update", "session": {"instructions": "x" * 65537}},
                {"type": "session.update", "session": {"instructions": "word " * 5000}},
                user_item("x" * 40000),
                {"type": "response.create", "response": {"instructions": "word " * 5000}},
                user_item("x" * 40000),
                {"type": "session.update", "session": {"instructions": "Be brief."}},
            ])  # fmt: skip
            return answers, ws.close_code

    outcome = under_attack(target, attack)
    (nested, too_much, too_long, item, own, item_too_much, fine), close = outcome.result
    assert nested["error"]["param"] == "type" and "nested" in nested["error"]["message"]
    assert too_much["error"]["param"] == "session.instructions"
    assert too_much["error"]["code"] == "conversation_full"
    assert too_long["error"]["param"] == "session.instructions"
    assert too_long["error"]["code"] == "context_length_exceeded"
    assert item["type"] == "conversation.item.created"
    # The response's own instructions, named as its field (not the session's, left empty).
    assert own["error"]["code"] == "context_length_exceeded"
    assert own["error"]["param"].startswith("response.instructions"), own
    assert item_too_much["error"]["code"] == "conversation_full"
    assert fine["type"] == "session.updated" and close is None  # still open
    outcome.assert_harmless(within=5 * FAST_S)


def test_realtime_sessions_are_capped_and_an_idle_one_is_closed(target, http):
    async def created(ws) -> dict:
        return json.loads(await ws.recv())

    check_capped_and_idle(
        http,
        "omni_chat",
        "/v1/realtime",
        lambda: websockets.connect(realtime_url(target)),
        created,
        "session.created",
        "--max-realtime-sessions",
    )


# --- process lifetime -----------------------------------------------------------------------------


def test_a_client_gone_stops_the_talker_and_a_killed_server_leaves_nothing(tmp_path):
    """Executor processes: a client that gives up on a long speech request stops its talker
    in a second or so; SIGKILL of the server ends its executors, and they remove their
    rings, the server's, and its log folder."""
    server = ServerProcess(
        [str(GRAPHS / "qwen3_tts.omni"), "--tiny"], env={"TMPDIR": str(tmp_path)}
    )
    try:
        executors = server.pids() - {server.proc.pid}
        # talker, code2wav and voice_encoder: on CPU, each stage in its own executor
        assert len(executors) == 3 and segments_of(server.pids())
        with server.client() as http:
            with pytest.raises(httpx.ReadTimeout), server.client(timeout=2) as impatient:
                impatient.post(SPEECH, json=LONG_SPEECH)
            wait_until(lambda: idle(http, "qwen3_tts"), timeout=10)
            with http.stream("POST", SPEECH, json={**LONG_SPEECH, "stream": True}) as reply:
                next(reply.iter_bytes())  # the talker is speaking
                server.proc.kill()
        server.proc.wait(10)
        wait_until(lambda: not any(map(alive, executors)), timeout=10)
        wait_until(lambda: not segments_of({server.proc.pid, *executors}), timeout=10)
        assert leftovers(tmp_path) == set()
    finally:  # the server's process group (its executors too), should a check have failed
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("path", ["/v1/videos", "/v1/images/generations"])
def test_an_endpoint_no_served_pipeline_answers_says_so(http, path):
    """Without a `model`, on a server of several pipelines none of which answers the
    endpoint: a 400 saying so, not a 404 asking for a model that would not help."""
    reply = http.post(path, json={"prompt": "a cat"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "unsupported" and error["param"] == "model", error
    assert f"no pipeline served here answers {path}" in error["message"], error
