"""Qwen3-TTS served as the peer's clients use it, against real `omniflow run` servers on the
tiny checkpoints: `POST /v1/audio/speech` (httpx and the `openai` client; every format,
streamed and whole, `speed`, the Qwen TTS fields checked at admission), the voices API
(named speakers, uploads encoded once), and `WebSocket /v1/audio/speech/stream` with a
real WebSocket client (text in pieces, cancel, errors, a dropped socket).

Two servers, each serving one speech pipeline so that no request needs a `model`:
graphs/qwen3_tts.omni on the CustomVoice checkpoint, and graphs/qwen3_tts_clone.omni on the
Base (voice clone) one, as shipped.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path

import av
import httpx
import numpy as np
import pytest
import soundfile
import torch
import websockets
from openai import OpenAI

from omniflow.catalog.resolve import model_path
from omniflow.compiler import compile_file
from omniflow.media import audio_bytes
from omniflow.runtime.interpreter import Interpreter
from tests.server.conftest import GRAPHS, ServerProcess, idle, metric, run_async, wait_until
from tests.server.fuzz import fuzz

RATE = 24000
FRAME = 1920  # samples of one 12.5 Hz frame
SPEECH = "/v1/audio/speech"
SOCKET = "/v1/audio/speech/stream"
FLAGS = ["--tiny", "--mode", "inprocess", "--param", "max_tokens=6"]
CLONE_GRAPH = GRAPHS / "qwen3_tts_clone.omni"  # the Base checkpoint's: voice clones


def reference_clip(seconds: float = 1.5) -> np.ndarray:
    t = np.arange(int(RATE * seconds)) / RATE
    noise = np.random.default_rng(0).standard_normal(len(t))
    return (0.3 * np.sin(2 * np.pi * (180 + 120 * t) * t) + 0.05 * noise).astype(np.float32)


def wav_file(samples: np.ndarray, subtype: str = "PCM_16") -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, RATE, format="WAV", subtype=subtype)
    return buffer.getvalue()


def mp3_data_uri(samples: np.ndarray) -> str:
    data = audio_bytes(torch.from_numpy(samples), RATE, "mp3")
    return "data:audio/mpeg;base64," + base64.b64encode(data).decode()


def decoded_seconds(data: bytes) -> float:
    """Seconds of audio in an encoded file, as PyAV (the peer's decoder) reads it."""
    with av.open(io.BytesIO(data)) as container:
        frames = list(container.decode(audio=0))
    return sum(f.samples for f in frames) / frames[0].sample_rate


@pytest.fixture(scope="module")
def custom(tmp_path_factory):
    """graphs/qwen3_tts.omni on tiny:qwen3-tts-customvoice."""
    server = ServerProcess([str(GRAPHS / "qwen3_tts.omni"), *FLAGS])
    yield server
    server.stop_cleanly()


@pytest.fixture(scope="module")
def clone():
    """graphs/qwen3_tts_clone.omni on tiny:qwen3-tts-base, keeping at most 3 uploaded voices."""
    server = ServerProcess([str(CLONE_GRAPH), *FLAGS, "--max-voices", "3"])
    yield server
    server.stop_cleanly()


@pytest.fixture(scope="module")
def clone_process():
    """The clone graph served with every stage in an executor process of its own."""
    flags = [f if f != "inprocess" else "process" for f in FLAGS]
    server = ServerProcess([str(CLONE_GRAPH), *flags])
    yield server
    server.stop_cleanly()


@pytest.fixture(scope="module")
def http(custom):
    with custom.client() as client:
        yield client


@pytest.fixture(scope="module")
def clone_http(clone):
    with clone.client() as client:
        yield client


# --- POST /v1/audio/speech ---------------------------------------------------------------------


def test_the_peers_request_needs_no_model_and_streams_pcm(http):
    """The peer's speech benchmark client's body, as it sends it: no `model`."""
    body = {"input": "Hello there.", "voice": "vivian", "language": "English", "stream": True,
            "response_format": "pcm"}  # fmt: skip
    began = time.perf_counter()
    first, data = None, b""
    with http.stream("POST", SPEECH, json=body) as reply:
        assert reply.status_code == 200, reply.read()
        assert reply.headers["content-type"] == "audio/pcm"
        for chunk in reply.iter_bytes():
            if chunk and first is None:
                first = time.perf_counter() - began
            data += chunk
    assert first is not None and len(data) % 2 == 0
    assert 0 < len(data) // 2 <= 6 * FRAME and len(data) // 2 % FRAME == 0


def talker_codes(tmp_path, inputs: dict, params: dict) -> torch.Tensor:
    """The codes the graph's talker makes for a request (the graph cut after its talker,
    run by the reference interpreter on the same tiny checkpoint), and code2wav's decoder."""
    source = (GRAPHS / "qwen3_tts.omni").read_text()
    source = re.sub(r"  stage code2wav = .*\n|  talker.codes -> code2wav.*\n", "", source)
    source = re.sub(
        r"  code2wav.audio -> .*\n", "  talker.codes -> output codes [stream]\n", source
    )
    path = tmp_path / "qwen3_tts_codes.omni"
    path.write_text(source)
    return Interpreter(compile_file(path, devices="cpu", tiny=True)).run(inputs, params)["codes"]


def test_streamed_audio_is_the_whole_decode_of_its_codes(http, tmp_path):
    """code2wav decodes each chunk after the state its stream carried from the last (the
    first chunk a single frame), and the PCM a client streams is the whole-utterance decode
    of the codes the talker made: within 1e-4, plus half a PCM step."""
    from omniflow.families.qwen3_tts.speech_tokenizer import load_decoder

    body = {"input": "Good morning to all of you.", "voice": "vivian", "language": "English",
            "seed": 9, "stream": True, "response_format": "pcm"}  # fmt: skip
    with http.stream("POST", SPEECH, json=body) as reply:
        assert reply.status_code == 200, reply.read()
        data = b"".join(reply.iter_bytes())
    served = torch.from_numpy(np.frombuffer(data, "<i2").astype(np.float32)) / 32767
    codes = talker_codes(
        tmp_path,
        {"text": body["input"], "voice": "Vivian"},
        {"seed": 9, "language": "English", "max_tokens": 6},
    )
    plan = compile_file(GRAPHS / "qwen3_tts.omni", devices="cpu", tiny=True)
    decoder = load_decoder(model_path(plan.stage("code2wav").model), "cpu")
    with torch.inference_mode():
        whole = decoder(codes.T[None]).reshape(-1)
    assert 0 < len(codes) <= 6 and served.shape == whole.shape
    assert float((served - whole).abs().max()) < 1e-4 + 0.5 / 32767


def test_whole_replies_in_every_format_decode(http):
    """wav, pcm and flac as they are; mp3, opus and aac encoded with FFmpeg's encoders
    (PyAV), as the peer decodes them; streamed or not. Every reply has the same audio
    length (the seed replays it)."""
    base = {"input": "Good morning.", "voice": "Ryan", "seed": 5}
    wav = http.post(SPEECH, json={**base, "response_format": "wav"})
    samples, rate = soundfile.read(io.BytesIO(wav.content), dtype="int16")
    assert wav.status_code == 200 and rate == RATE and len(samples) % FRAME == 0
    seconds = len(samples) / RATE
    pcm = http.post(SPEECH, json={**base, "response_format": "pcm"}).content
    assert np.array_equal(np.frombuffer(pcm, "<i2"), samples)
    flac = http.post(SPEECH, json={**base, "response_format": "flac"})
    assert np.array_equal(soundfile.read(io.BytesIO(flac.content), dtype="int16")[0], samples)
    for fmt, mime in (("mp3", "audio/mpeg"), ("opus", "audio/ogg"), ("aac", "audio/aac")):
        for stream in (False, True):
            reply = http.post(SPEECH, json={**base, "response_format": fmt, "stream": stream})
            assert reply.status_code == 200 and reply.headers["content-type"] == mime, fmt
            # Encoders pad a little at the ends (an MP3 or AAC frame, Opus's pre-skip).
            assert abs(decoded_seconds(reply.content) - seconds) < 0.13, (fmt, stream)


def test_speed_stretches_the_audio_keeping_its_length_right(http):
    base = {"input": "Good morning.", "voice": "Ryan", "seed": 5, "response_format": "pcm"}
    normal = len(http.post(SPEECH, json=base).content) // 2
    for speed in (0.5, 2.0, 4.0):
        for stream in (False, True):
            reply = http.post(SPEECH, json={**base, "speed": speed, "stream": stream})
            assert reply.status_code == 200
            # atempo's last window (up to ~40 ms) is where its output may fall short.
            assert abs(len(reply.content) // 2 - normal / speed) < 0.04 * RATE, (speed, stream)


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"task_type": "Base"}, "task_type", "this checkpoint (CustomVoice) does only CustomVoice"),
        ({"language": "Klingon"}, "language", "unknown language 'Klingon'; this model speaks Auto"),
        ({"voice": "Nobody"}, "voice", "unknown speaker 'Nobody'"),
        ({"ref_audio": "data:audio/wav;base64,AAAA"}, "ref_audio", "does not clone voices"),
        ({"ref_text": "abc"}, "ref_text", "does not clone voices (ref_text given)"),
        ({"x_vector_only_mode": True}, "x_vector_only_mode", "does not clone voices"),
        ({"x_vector_only_mode": "yes"}, "x_vector_only_mode", "valid boolean"),
        ({"max_new_tokens": 100000}, "max_new_tokens", "compiled for max_tokens=2048"),
        ({"speed": 5.0}, "speed", "'speed' must be in 0.25 .. 4"),
        ({"response_format": "ogg"}, "response_format", "wav, pcm, flac, mp3, opus, aac"),
        ({"stream": True, "response_format": "flac"}, "response_format", "streamed speech"),
        ({"stream_format": "sse", "response_format": "flac"}, "response_format", "streamed"),
        ({"stream_format": "json"}, "stream_format", "use one of audio, sse"),
        ({"input": " "}, "input", "must not be empty"),
        ({"temperature": 0.5}, "temperature", "unknown field 'temperature'"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(http, body, param, message):
    before = metric(http, "omniflow_voice_encodes_total", model="qwen3_tts")
    reply = http.post(SPEECH, json={"input": "Hi.", **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert idle(http, "qwen3_tts")  # refused at admission: no stage saw it
    assert metric(http, "omniflow_voice_encodes_total", model="qwen3_tts") == before


def test_the_openai_client(custom):
    client = OpenAI(base_url=custom.url, api_key="unused", max_retries=0, timeout=60)
    reply = client.audio.speech.create(
        model="qwen3_tts", voice="vivian", input="Good morning.", response_format="wav",
        extra_body={"language": "English", "instructions": "Cheerfully."},
    )  # fmt: skip
    samples, rate = soundfile.read(io.BytesIO(reply.content), dtype="int16")
    assert rate == RATE and len(samples) % FRAME == 0 and len(samples)
    with client.audio.speech.with_streaming_response.create(
        model="qwen3_tts", voice="aiden", input="Good morning.", response_format="pcm"
    ) as streamed:
        data = b"".join(streamed.iter_bytes())
    assert data and len(data) % (2 * FRAME) == 0


def test_openai_speech_events_carry_the_audio_the_stream_does(custom, http):
    """`stream_format: "sse"` (OpenAI's client sends it): `speech.audio.delta` events whose
    audio, joined, is the bytes the same request streams raw, then `speech.audio.done`
    with the talker's counts: its codes are the audio's frames (one more where the talker
    ended itself: its end token)."""
    client = OpenAI(base_url=custom.url, api_key="unused", max_retries=0, timeout=60)
    asked = {"model": "qwen3_tts", "voice": "vivian", "input": "Good morning.",
             "response_format": "pcm"}  # fmt: skip
    with client.audio.speech.with_streaming_response.create(
        **asked, stream_format="sse", extra_body={"seed": 4}
    ) as streamed:
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line]
    *deltas, done = events
    assert {e["type"] for e in deltas} == {"speech.audio.delta"} and deltas
    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    with http.stream("POST", SPEECH, json={**asked, "stream": True, "seed": 4}) as reply:
        assert audio == b"".join(reply.iter_bytes())
    usage = done["usage"]
    assert done["type"] == "speech.audio.done"
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert len(audio) // 2 // FRAME in (usage["output_tokens"], usage["output_tokens"] - 1)


def test_requests_batch_across_users_in_every_stage(http):
    """Six requests at once: the talker (its code predictor's sub-steps included) and
    code2wav each step several of them together."""

    def batched(stage: str) -> float:
        singles = metric(http, "omniflow_stage_batch_size_bucket", le="1.0",
                         model="qwen3_tts", stage=stage)  # fmt: skip
        steps = metric(http, "omniflow_stage_batch_size_count", model="qwen3_tts", stage=stage)
        return steps - singles

    before = {stage: batched(stage) for stage in ("talker", "code2wav")}

    async def many():
        async with httpx.AsyncClient(base_url=http.base_url, timeout=60) as client:
            body = {"input": "Good morning to all of you.", "voice": "Serena"}
            replies = await asyncio.gather(*(client.post(SPEECH, json=body) for _ in range(6)))
        return [r.status_code for r in replies]

    assert run_async(many) == [200] * 6
    for stage, count in before.items():
        assert batched(stage) > count, stage


README_CURL = """\
curl -s http://127.0.0.1:8091/v1/audio/speech -H 'Content-Type: application/json' -d '{
  "input": "Good morning!", "voice": "vivian", "language": "English", "response_format": "mp3"
}' > speech.mp3
curl -s http://127.0.0.1:8091/v1/audio/voices > voices.json
"""


def test_the_readmes_speech_snippet_as_written(custom, tmp_path):
    readme = (GRAPHS.parent / "README.md").read_text()
    assert f"```bash\n{README_CURL}```" in readme
    assert "omniflow run graphs/qwen3_tts.omni --tiny" in readme
    script = README_CURL.replace("127.0.0.1:8091", custom.base.removeprefix("http://"))
    subprocess.run(["bash", "-c", script], cwd=tmp_path, check=True, timeout=120)
    assert decoded_seconds((tmp_path / "speech.mp3").read_bytes()) > 0
    assert "Vivian" in json.loads((tmp_path / "voices.json").read_text())["voices"]


# --- voices -------------------------------------------------------------------------------------


def test_voices_lists_the_named_speakers(http):
    listing = http.get("/v1/audio/voices").json()
    assert {"Vivian", "Ryan", "Serena", "Uncle_Fu"} <= set(listing["voices"])
    assert all(v["type"] == "builtin" for v in listing["data"])
    files = {"audio": ("ref.wav", wav_file(reference_clip()), "audio/wav")}
    reply = http.post("/v1/audio/voices", data={"name": "alice"}, files=files)
    assert reply.status_code == 400 and "clones no voices" in reply.json()["error"]["message"]


def test_an_uploaded_voice_is_encoded_once(clone_http):
    """The clip is encoded at upload (the model's speaker encoder and speech tokenizer);
    requests naming the voice encode nothing, and sound as a request with the clip inline."""
    encodes = lambda: metric(clone_http, "omniflow_voice_encodes_total", model="qwen3_tts_clone")  # noqa: E731
    clip = reference_clip()
    files = {"audio": ("ref.wav", wav_file(clip), "audio/wav")}
    before = encodes()
    reply = clone_http.post(
        "/v1/audio/voices", data={"name": "alice", "ref_text": "Hello there."}, files=files
    )
    assert reply.status_code == 201, reply.text
    assert reply.json()["audio_seconds"] == 1.5 and encodes() == before + 1
    body = {"input": "Good morning.", "voice": "alice", "seed": 3, "response_format": "pcm"}
    named = [clone_http.post(SPEECH, json=body) for _ in range(2)]
    assert all(r.status_code == 200 for r in named) and encodes() == before + 1
    assert named[0].content == named[1].content and named[0].content
    inline = {**body, "voice": None, "ref_text": "Hello there.",
              "ref_audio": "data:audio/wav;base64," + base64.b64encode(wav_file(clip)).decode()}  # fmt: skip
    assert clone_http.post(SPEECH, json=inline).content == named[0].content
    assert encodes() == before + 2
    listing = clone_http.get("/v1/audio/voices").json()
    assert "alice" in listing["voices"]
    assert clone_http.delete("/v1/audio/voices/alice").status_code == 200
    assert clone_http.post(SPEECH, json=body).status_code == 400  # a named voice no more


def test_a_clone_as_the_peer_sends_it(clone_http):
    """`ref_audio` as an mp3 data URI, `ref_text`, `task_type` Base, no `model`; and the
    x-vector alone, without a transcript."""
    uri = mp3_data_uri(reference_clip())
    body = {"input": "Good morning.", "task_type": "Base", "language": "English",
            "ref_audio": uri, "ref_text": "Hello there.", "response_format": "wav"}  # fmt: skip
    reply = clone_http.post(SPEECH, json=body)
    assert reply.status_code == 200, reply.text
    assert soundfile.read(io.BytesIO(reply.content))[1] == RATE
    del body["ref_text"]
    assert clone_http.post(SPEECH, json={**body, "x_vector_only_mode": True}).status_code == 200
    reply = clone_http.post(SPEECH, json=body)  # ICL needs the transcript
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "ref_text"


def test_the_openai_client_clones_inline_and_uploaded(clone, clone_http):
    """The shipped clone graph through the `openai` client: a reference inline (extra_body),
    then the same clip uploaded and named as the voice: the same seed, the same speech."""
    client = OpenAI(base_url=clone.url, api_key="unused", max_retries=0, timeout=60)
    clip = wav_file(reference_clip())
    inline = client.audio.speech.create(
        model="qwen3_tts_clone", voice="", input="Good morning.", response_format="wav",
        extra_body={"ref_audio": "data:audio/wav;base64," + base64.b64encode(clip).decode(),
                    "ref_text": "Hello there.", "seed": 7},
    )  # fmt: skip
    samples, rate = soundfile.read(io.BytesIO(inline.content), dtype="int16")
    assert rate == RATE and len(samples) and len(samples) % FRAME == 0
    files = {"audio": ("ref.wav", clip, "audio/wav")}
    reply = clone_http.post(
        "/v1/audio/voices", data={"name": "openai_voice", "ref_text": "Hello there."}, files=files
    )
    assert reply.status_code == 201, reply.text
    named = client.audio.speech.create(
        model="qwen3_tts_clone", voice="openai_voice", input="Good morning.",
        response_format="wav", extra_body={"seed": 7},
    )  # fmt: skip
    assert named.content == inline.content
    assert clone_http.delete("/v1/audio/voices/openai_voice").status_code == 200


def test_the_suggested_requests_speak_and_clone(custom, clone, clone_http, tmp_path):
    """The `curl` lines each server prints at start-up, pasted as printed: a named-voice
    server's one speech request; a clone server's upload of the user's clip (here a
    reference.wav) and a request naming it. Each capped (max_new_tokens), each in seconds."""
    (wav,) = custom.suggested("qwen3_tts")
    upload, speak = clone.suggested("qwen3_tts_clone")
    (tmp_path / "reference.wav").write_bytes(wav_file(reference_clip()))
    for line, status in ((wav, "200"), (upload, "201"), (speak, "200")):
        assert "max_new_tokens" in line or line is upload
        began = time.monotonic()
        done = subprocess.run(
            [*shlex.split(line), "-s", "-o", "reply", "-w", "%{http_code}"],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.stdout == status, (tmp_path / "reply").read_text(errors="replace")
        assert time.monotonic() - began < 60
    assert soundfile.read(tmp_path / "reply")[1] == RATE
    voice = json.loads(shlex.split(speak)[-1])["voice"]
    assert clone_http.delete(f"/v1/audio/voices/{voice}").status_code == 200


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({}, "ref_audio", "voice cloning (Base) needs ref_audio"),
        ({"voice": "Vivian"}, "voice", "a Base model has no named voices"),
        ({"ref_audio": "data:audio/mpeg;base64,AAAA"}, "ref_audio", "not an audio file"),
        ({"ref_audio": "not base64!"}, "ref_audio", "not valid base64"),
        ({"ref_audio": "data:audio/wav;base64," + base64.b64encode(wav_file(np.zeros(0, np.float32))).decode()},
         "ref_audio", "no samples"),
        ({"ref_audio": "https://example.com/a.wav"}, "ref_audio", "remote URLs are off"),
        ({"ref_audio": "data:audio/wav;base64," + base64.b64encode(wav_file(np.full(RATE, np.nan, np.float32), "FLOAT")).decode()},
         "ref_audio", "NaN or infinite"),
    ],
)  # fmt: skip
def test_a_bad_clone_is_a_400_naming_its_field(clone_http, body, param, message):
    reply = clone_http.post(SPEECH, json={"input": "Hi.", "x_vector_only_mode": True, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_the_voice_store_is_bounded_and_checks_its_uploads(clone_http):
    clip = {"audio": ("ref.wav", wav_file(reference_clip(0.5)), "audio/wav")}
    post = lambda name, files=clip, **data: clone_http.post(  # noqa: E731
        "/v1/audio/voices", data={"name": name, **data}, files=files
    )
    bad = {"audio": ("x.wav", b"RIFF nonsense", "audio/wav")}
    reply = post("broken", bad)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "audio"
    assert post("bad name!").json()["error"]["param"] == "name"
    names = ["v1", "v2", "v3"]
    for name in names:
        assert post(name).status_code == 201
    # Refused before the clip goes to the voice encoder stage: nothing encoded for them.
    encodes = metric(clone_http, "omniflow_voice_encodes_total", model="qwen3_tts_clone")
    assert post("v1").json()["error"]["code"] == "voice_exists"
    full = post("v4")
    assert full.status_code == 400 and full.json()["error"]["code"] == "voice_store_full"
    assert metric(clone_http, "omniflow_voice_encodes_total", model="qwen3_tts_clone") == encodes
    for name in names:
        assert clone_http.delete(f"/v1/audio/voices/{name}").status_code == 200
    assert clone_http.delete("/v1/audio/voices/v1").status_code == 404


def executor_pid(server: ServerProcess, name: str) -> int:
    """The pid of the executor process named `name` (its stdout is its own log file)."""
    for pid in server.pids() - {server.proc.pid}:
        if Path(os.readlink(f"/proc/{pid}/fd/1")).name == f"{name}.log":
            return pid
    raise AssertionError(f"no executor {name} among {server.pids()}")


def stage_steps(http, model: str) -> dict[str, int]:
    """Each stage's steps so far, and the executor it runs in, from /debug/inspect."""
    executors = http.get("/debug/inspect").json()[model]["executors"]
    return {
        (stage, name): totals[0]
        for name, found in executors.items()
        for stage, totals in found["stages"].items()
    }


def test_the_plan_encodes_uploads_in_an_executor_process(clone_process):
    """In process mode an upload runs the voice_encoder stage alone, in its executor (a
    process of its own, the plan's: the API process loads no encoder); a voice named by a
    request clones as its clip given inline does, with the same seed; an executor killed
    during an upload fails that upload (a 500 that says so) and the next one works."""
    with clone_process.client(timeout=60) as http:
        model = "qwen3_tts_clone"
        before = stage_steps(http, model)
        assert ("voice_encoder", "voice_encoder") in before  # its own executor
        clip = wav_file(reference_clip())
        files = {"audio": ("ref.wav", clip, "audio/wav")}
        data = {"name": "carol", "ref_text": "Hello there."}
        assert http.post("/v1/audio/voices", data=data, files=files).status_code == 201
        after = stage_steps(http, model)
        ran = {key: after[key] - before[key] for key in after if after[key] != before[key]}
        assert ran == {("voice_encoder", "voice_encoder"): 1}, ran  # nothing else ran
        body = {"input": "Good morning.", "voice": "carol", "seed": 5, "response_format": "pcm"}
        named = http.post(SPEECH, json=body)
        inline = {**body, "voice": None, "ref_text": "Hello there.",
                  "ref_audio": "data:audio/wav;base64," + base64.b64encode(clip).decode()}  # fmt: skip
        assert named.status_code == 200 and named.content
        assert http.post(SPEECH, json=inline).content == named.content

        # SIGSTOP holds the encoder mid-upload; SIGKILL ends it there.
        encoder = executor_pid(clone_process, "voice_encoder")
        os.kill(encoder, signal.SIGSTOP)
        result = {}
        upload = threading.Thread(
            target=lambda: result.update(
                reply=http.post("/v1/audio/voices", data={**data, "name": "dave"}, files=files)
            )
        )
        upload.start()
        # The upload reaches the stopped executor and waits there: parsing and admitting a
        # short clip takes well under a second, given generous room on a loaded machine
        # (an upload admitted only after the restart would succeed, and the check fail).
        time.sleep(5.0)
        assert upload.is_alive()
        os.kill(encoder, signal.SIGKILL)
        upload.join(60)
        error = result["reply"].json()["error"]
        assert result["reply"].status_code == 500 and "died" in error["message"], error
        assert "dave" not in http.get("/v1/audio/voices").json()["voices"]
        wait_until(
            lambda: (
                http.post(
                    "/v1/audio/voices", data={**data, "name": "erin"}, files=files
                ).status_code
                == 201
            ),
            timeout=60,
            step=0.5,
        )
        assert executor_pid(clone_process, "voice_encoder") != encoder  # restarted
        erin = http.post(SPEECH, json={**body, "voice": "erin"})
        assert erin.content == named.content  # encoded as before the restart


# --- WebSocket /v1/audio/speech/stream -----------------------------------------------------------


def ws_url(server: ServerProcess) -> str:
    return server.base.replace("http://", "ws://") + SOCKET


async def session(url: str, start: dict, messages: list[dict]) -> tuple[list, bytes, object]:
    """Send `start` then `messages`; every control message, the audio, the close code."""
    controls, audio = [], b""
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.start", **start}))
        for message in messages:
            await ws.send(json.dumps(message))
        try:
            async for frame in ws:
                if isinstance(frame, bytes):
                    audio += frame
                else:
                    controls.append(json.loads(frame))
        except websockets.ConnectionClosedError:
            pass  # closed with a code other than 1000: the caller checks which
        return controls, audio, ws.close_code


def test_text_in_pieces_comes_back_as_audio_per_sentence(custom):
    pieces = ["Hello ", "there. How ", "are", " you today? And", " goodbye"]
    messages = [{"type": "input.text", "text": p} for p in pieces] + [{"type": "input.done"}]
    controls, audio, code = run_async(
        lambda: session(ws_url(custom), {"voice": "vivian", "language": "English"}, messages)
    )
    assert code == 1000
    started = controls[0]
    assert started["type"] == "session.started" and started["sample_rate"] == RATE
    texts = [c["text"] for c in controls if c["type"] == "segment.started"]
    assert texts == ["Hello there.", "How are you today?", "And goodbye"]
    done = [c for c in controls if c["type"] == "segment.done"]
    assert [d["segment"] for d in done] == [0, 1, 2]
    assert controls[-1] == {"type": "session.done", "segments": 3,
                            "audio_seconds": len(audio) / 2 / RATE}  # fmt: skip
    assert len(audio) // 2 == round(sum(d["audio_seconds"] for d in done) * RATE)


def test_audio_frames_arrive_before_the_text_ends(custom):
    """The first sentence's audio comes while the client still holds the rest of its text."""

    async def run():
        async with websockets.connect(ws_url(custom)) as ws:
            await ws.send(json.dumps({"type": "session.start", "voice": "Ryan"}))
            assert json.loads(await ws.recv())["type"] == "session.started"
            await ws.send(json.dumps({"type": "input.text", "text": "First sentence. Sec"}))
            kinds = []
            while not kinds or kinds[-1] != "bytes":
                frame = await ws.recv()
                kinds.append("bytes" if isinstance(frame, bytes) else json.loads(frame)["type"])
            await ws.send(json.dumps({"type": "input.text", "text": "ond one."}))
            await ws.send(json.dumps({"type": "input.done"}))
            async for _ in ws:
                pass
            return kinds, ws.close_code

    kinds, code = run_async(run)
    assert kinds == ["segment.started", "bytes"] and code == 1000


def test_cancel_stops_the_segments_and_the_session_goes_on(custom, http):
    async def run():
        async with websockets.connect(ws_url(custom)) as ws:
            # Seed 5 speaks this text for 330 frames (26 s) before its end of speech.
            start = {"voice": "Ryan", "max_new_tokens": 2000, "seed": 5, "response_format": "wav"}
            await ws.send(json.dumps({"type": "session.start", **start}))
            await ws.recv()
            await ws.send(json.dumps({"type": "input.text", "text": "A very long one. "}))
            while not isinstance(await ws.recv(), bytes):
                pass
            await ws.send(json.dumps({"type": "cancel"}))
            while (frame := await ws.recv()) and (
                isinstance(frame, bytes) or json.loads(frame)["type"] != "cancelled"
            ):
                pass
            cancelled = json.loads(frame)
            await ws.send(json.dumps({"type": "input.text", "text": "Short."}))
            await ws.send(json.dumps({"type": "input.done"}))
            rest = [json.loads(f) async for f in ws if not isinstance(f, bytes)]
            return cancelled, rest, ws.close_code

    cancelled, rest, code = run_async(run)
    assert cancelled == {"type": "cancelled", "segments": [0]}
    assert [m["type"] for m in rest] == ["segment.started", "segment.done", "session.done"]
    assert rest[0]["segment"] == 1 and code == 1000
    wait_until(lambda: idle(http, "qwen3_tts"))


def test_a_client_that_drops_the_socket_frees_every_stage(custom, http):
    gauge = lambda: metric(http, "omniflow_requests_in_flight", model="qwen3_tts")  # noqa: E731

    async def run():
        ws = await websockets.connect(ws_url(custom))
        start = {"voice": "Ryan", "max_new_tokens": 2000, "seed": 5}  # 330 frames
        await ws.send(json.dumps({"type": "session.start", **start}))
        await ws.recv()
        await ws.send(json.dumps({"type": "input.text", "text": "A very long one. "}))
        while not isinstance(await ws.recv(), bytes):
            pass
        held = gauge(), sessions()
        ws.transport.abort()  # gone: no close frame
        return held

    sessions = lambda: metric(  # noqa: E731
        http, "omniflow_websocket_sessions", model="qwen3_tts", endpoint="/v1/audio/speech/stream"
    )
    requests, open_sessions = run_async(run)
    assert requests >= 1 and open_sessions == 1
    wait_until(lambda: gauge() == 0 and idle(http, "qwen3_tts"))
    assert sessions() == 0


@pytest.mark.parametrize(
    "start, messages, param",
    [
        ({"voice": "Nobody"}, [], "voice"),
        ({"task_type": "VoiceDesign"}, [], "task_type"),
        ({"response_format": "mp3"}, [], "response_format"),
        ({"input": "Hi"}, [], "input"),
        ({"stream_format": "sse"}, [], "stream_format"),
        ({}, [{"type": "input.text", "text": 7}], "text"),
        ({}, [{"type": "shout"}], "type"),
        ({}, [{"type": "input.text", "text": "Hi.", "lang": "en"}], "text"),
        ({}, [{"type": "input.flush", "now": True}], "now"),
    ],
)
def test_a_bad_message_is_an_error_then_the_socket_closes(custom, start, messages, param):
    controls, _, code = run_async(lambda: session(ws_url(custom), start, messages))
    errors = [c for c in controls if c["type"] == "error"]
    assert code == 1008 and len(errors) == 1 and errors[0]["error"]["param"] == param, controls


def test_a_session_clones_an_uploaded_voice(clone, clone_http):
    files = {"audio": ("ref.wav", wav_file(reference_clip()), "audio/wav")}
    assert clone_http.post("/v1/audio/voices", data={"name": "bob"}, files=files).status_code == 201
    encodes = metric(clone_http, "omniflow_voice_encodes_total", model="qwen3_tts_clone")
    messages = [{"type": "input.text", "text": "One. Two."}, {"type": "input.done"}]
    start = {"voice": "bob", "x_vector_only_mode": True}
    controls, audio, code = run_async(lambda: session(ws_url(clone), start, messages))
    assert code == 1000 and audio and controls[-1]["segments"] == 2
    assert metric(clone_http, "omniflow_voice_encodes_total", model="qwen3_tts_clone") == encodes
    clone_http.delete("/v1/audio/voices/bob")


def test_fuzzed_requests_get_no_5xx(custom, http, clone, clone_http):
    """Schemathesis on both servers' schemas (the speech fields, the voices API): no 5xx;
    some generated requests spoke (a clone needs a real clip: those are all refused)."""
    counts = fuzz(custom.base, examples=10)
    assert sum(c.get(200, 0) for op, c in counts.items() if op.startswith("POST")) > 0
    fuzz(clone.base, examples=10)
    for client, model in ((http, "qwen3_tts"), (clone_http, "qwen3_tts_clone")):
        wait_until(lambda c=client, m=model: idle(c, m), timeout=30)


def test_the_socket_and_the_voices_need_the_api_key(start_server):
    server = start_server(str(GRAPHS / "qwen3_tts.omni"), *FLAGS, "--api-key", "sesame")
    assert httpx.get(server.base + "/v1/audio/voices").status_code == 401
    headers = {"Authorization": "Bearer sesame"}
    assert httpx.get(server.base + "/v1/audio/voices", headers=headers).status_code == 200

    async def opens(url: str, **kwargs) -> bool:
        try:
            async with websockets.connect(url, **kwargs) as ws:
                await ws.send(json.dumps({"type": "session.start", "voice": "Ryan"}))
                return json.loads(await ws.recv())["type"] == "session.started"
        except websockets.InvalidStatus as err:
            assert err.response.status_code == 403
            return False

    url = ws_url(server)
    assert not run_async(lambda: opens(url))
    assert not run_async(lambda: opens(url + "?api_key=wrong"))
    assert run_async(lambda: opens(url, additional_headers=headers))
    assert run_async(lambda: opens(url + "?api_key=sesame"))
