"""docs/server.md's examples run as written, so that they cannot drift: every fenced `curl`
(bash) and Python block that calls a server, in the order a reader pastes them, in one
folder, against the two servers the doc starts with the commands it shows (their port
changed to a free one, their executors threads: `--mode inprocess`, so that they start in
seconds on a small machine). Only the port in each example is changed. Each example is
checked for what it says it makes: WAV, PCM, MP3, PNG and MP4 files that decode to what was
asked, JSON with its fields, and, where the doc prints an example's output, that output.
"""

from __future__ import annotations

import ast
import base64
import io
import json
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import av
import pytest
import soundfile
from PIL import Image

from omniflow.media import decode_video
from tests.server.conftest import ROOT, ServerProcess

DOC = (ROOT / "docs" / "server.md").read_text()
PORTS = ("8091", "8092")  # the examples' server, and the voice-clone one
RATE = 24000
SERVED = ["omni_chat", "qwen3_tts", "text_to_image", "image_edit", "text_to_video"]


def fenced(text: str) -> list[tuple[str, str]]:
    """Each fenced block of `text` as (language, body)."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)


def printed(first_line: str) -> list[str]:
    """The lines of the one plain block that shows an output starting with `first_line`."""
    found = [b for lang, b in fenced(DOC) if not lang and b.startswith(first_line)]
    assert len(found) == 1, first_line
    return found[0].splitlines()


EXAMPLES = DOC.split("## Examples: every endpoint\n")[1].split("\n## ")[0]
SERVER_COMMANDS = [b for lang, b in fenced(EXAMPLES) if lang == "bash" and b.startswith("omniflow")]
CALLS = [
    (lang, body)
    for lang, body in fenced(DOC)
    if lang in ("bash", "python")
    and any(f"127.0.0.1:{port}" in body for port in PORTS)
    and not body.startswith("omniflow")
]


def server_args(command: str) -> tuple[str, list[str]]:
    """An `omniflow run ...` command of the doc as (its port, the arguments that start it
    here on a free port: ServerProcess adds `run --port 0`)."""
    words = shlex.split(command.replace("\\\n", " "), comments=True)
    assert words[:2] == ["omniflow", "run"], command
    args, port = words[2:], "8091"
    if "--port" in args:
        at = args.index("--port")
        port = args[at + 1]
        del args[at : at + 2]
    return port, [*args, "--mode", "inprocess"]


@pytest.fixture(scope="module")
def servers():
    """The doc's servers by the port it gives them, started at once."""
    assert len(SERVER_COMMANDS) == 2
    commands = dict(map(server_args, SERVER_COMMANDS))
    assert sorted(commands) == sorted(PORTS)
    with ThreadPoolExecutor(len(commands)) as pool:
        starting = {port: pool.submit(ServerProcess, args) for port, args in commands.items()}
    started = {port: future.result() for port, future in starting.items() if not future.exception()}
    if len(started) < len(starting):  # one did not start: stop the other, say why
        for server in started.values():
            server.stop()
        raise next(f.exception() for f in starting.values() if f.exception())
    yield started
    for server in started.values():
        server.stop_cleanly()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """Where the examples run, one after another, as in a reader's terminal."""
    return tmp_path_factory.mktemp("examples")


# --- what each example makes ---------------------------------------------------------------


def wav_seconds(path: Path) -> float:
    samples, rate = soundfile.read(path)
    assert rate == RATE
    return len(samples) / rate


def pcm_seconds(path: Path) -> float:
    data = path.read_bytes()
    assert len(data) % 2 == 0
    return len(data) / 2 / RATE


def png_size(data: bytes) -> tuple[int, int]:
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG"
    return image.size


def b64_png_size(path: Path) -> tuple[int, int]:
    return png_size(base64.b64decode(json.loads(path.read_text())["data"][0]["b64_json"]))


def check_mp4(path: Path) -> None:
    frames, fps, codec = decode_video(path.read_bytes())
    assert frames.shape == (5, 32, 32, 3) and fps == 16 and codec == "h264"


def curl_chat(folder: Path, out: str) -> None:
    message = json.loads((folder / "chat.json").read_text())["choices"][0]["message"]
    assert message["content"] and message["content"] in out
    assert wav_seconds(folder / "chat.wav") > 0
    events = [line.removeprefix("data: ") for line in (folder / "chat.sse").read_text().split(
        "\n\n") if line]  # fmt: skip
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas)
    assert (
        sum(len(base64.b64decode(d["audio"].get("data", ""))) for d in deltas if "audio" in d) > 0
    )
    assert chunks[-1]["usage"]["completion_tokens"] == 16


def openai_chat(folder: Path, out: str) -> None:
    assert out.strip()
    assert wav_seconds(folder / "reply.wav") > 0
    assert wav_seconds(folder / "streamed.wav") > 0


def curl_speech(folder: Path, out: str) -> None:
    assert 0 < wav_seconds(folder / "speech.wav") <= 24 * 0.08
    assert 0 < pcm_seconds(folder / "speech.pcm") <= 24 * 0.08
    assert "Vivian" in json.loads((folder / "voices.json").read_text())["voices"]


def openai_speech(folder: Path, out: str) -> None:
    with av.open(str(folder / "speech.mp3")) as container:
        assert container.format.name == "mp3"
        assert sum(f.samples for f in container.decode(audio=0)) > 0
    assert pcm_seconds(folder / "speech_streamed.pcm") > 0


def voice_clone(folder: Path, out: str) -> None:
    alice = json.loads((folder / "alice.json").read_text())
    assert alice["name"] == "alice" and alice["type"] == "uploaded" and alice["audio_seconds"] > 0
    assert wav_seconds(folder / "alice.wav") > 0
    assert json.loads((folder / "forgotten.json").read_text()) == {"name": "alice", "deleted": True}


def curl_images(folder: Path, out: str) -> None:
    assert png_size((folder / "image.png").read_bytes()) == (64, 64)
    assert b64_png_size(folder / "image.json") == (64, 64)
    assert b64_png_size(folder / "edited.json") == (64, 64)


def openai_images(folder: Path, out: str) -> None:
    assert png_size((folder / "boat.png").read_bytes()) == (64, 64)
    assert png_size((folder / "boat_blue.png").read_bytes()) == (64, 64)


def curl_videos(folder: Path, out: str) -> None:
    progress = [line.split() for line in out.splitlines()]
    assert progress[-1] == ["completed", "100"], out
    check_mp4(folder / "video.mp4")
    check_mp4(folder / "sync.mp4")
    assert json.loads((folder / "deleted.json").read_text())["deleted"] is True


def openai_videos(folder: Path, out: str) -> None:
    assert out.splitlines()[-1] == "completed 100"
    check_mp4(folder / "cat.mp4")


def curl_models(folder: Path, out: str) -> None:
    models = json.loads((folder / "models.json").read_text())["data"]
    assert [m["id"] for m in models] == SERVED
    assert models[0]["endpoints"] == ["/v1/chat/completions"]
    assert models[0]["root"] == "tiny:qwen2.5-omni" and models[0]["max_in_flight"] > 0
    assert json.loads((folder / "health.json").read_text()) == {"status": "ok", "models": SERVED}
    requests = (folder / "requests.txt").read_text().splitlines()
    assert requests and all(line.startswith("omniflow_requests_total{") for line in requests)


def openai_models(folder: Path, out: str) -> None:
    assert [line.split()[0] for line in out.splitlines()] == SERVED
    assert "omni_chat ['/v1/chat/completions']" in out


def speech_stream(folder: Path, out: str) -> None:
    """What it prints is what the doc shows, but for the audio's length: the tiny talker may
    stop before `max_new_tokens`."""
    got = [ast.literal_eval(line) for line in out.splitlines()]
    shown = [ast.literal_eval(line) for line in printed("{'type': 'session.started'")]
    lengths = [event.pop("audio_seconds", None) for event in got]
    for event in shown:
        event.pop("audio_seconds", None)
    assert got == shown
    segments = [s for s, e in zip(lengths, got, strict=True) if e["type"] == "segment.done"]
    assert all(0 < s <= 6 * 0.08 for s in segments)
    assert lengths[-1] == pytest.approx(sum(segments))
    assert pcm_seconds(folder / "speech_stream.pcm") == pytest.approx(lengths[-1])


def realtime_openai(folder: Path, out: str) -> None:
    status, tokens = out.splitlines()[-1].split()
    assert (status, tokens) == ("incomplete", "16")


def realtime_websockets(folder: Path, out: str) -> None:
    """The events it prints are those the doc shows (its `...` stands for more transcript
    deltas, its last two lines for the random text and the audio's length; the talker's
    codes, unseeded, are as many as it happened to make)."""

    def codes_any(lines: list[str]) -> list[str]:
        return [re.sub(r"('audio_tokens': )\d+\}\}$", r"\1N}}", line) for line in lines]

    shown = codes_any(printed("session.created\n"))
    head, tail = shown[: shown.index("...")], shown[shown.index("...") + 1 : -2]
    lines = codes_any(out.splitlines())
    end = next(i for i, line in enumerate(lines) if line.startswith("incomplete "))
    assert lines[: len(head)] == head
    assert lines[end + 1 - len(tail) : end + 1] == tail
    assert set(lines[len(head) : end + 1 - len(tail)]) == {"response.audio_transcript.delta"}
    assert re.fullmatch(r"\d+\.\d\d s of audio", lines[-1])


# Each example by a text only it has, in the doc's order, with its check.
CHECKS = {
    "> chat.json": curl_chat,
    '"streamed.wav"': openai_chat,
    "> speech.pcm": curl_speech,
    '"speech.mp3"': openai_speech,
    "> alice.json": voice_clone,
    "> edited.json": curl_images,
    '"boat_blue.png"': openai_images,
    "/v1/videos/sync": curl_videos,
    '"cat.mp4"': openai_videos,
    "> models.json": curl_models,
    "client.models.list()": openai_models,
    '"speech_stream.pcm"': speech_stream,
    "client.realtime.connect": realtime_openai,
    "/v1/realtime?model=omni_chat": realtime_websockets,
}


def example(needle: str) -> tuple[str, str]:
    found = [call for call in CALLS if needle in call[1]]
    assert len(found) == 1, f"{len(found)} examples have {needle!r}"
    return found[0]


def test_every_example_has_its_check_in_the_docs_order():
    assert [example(needle) for needle in CHECKS] == CALLS


@pytest.mark.parametrize("needle", CHECKS)
def test_the_example_runs_as_written(needle, servers, folder):
    lang, body = example(needle)
    for port, server in servers.items():
        body = body.replace(f"127.0.0.1:{port}", server.base.removeprefix("http://"))
    command = ["bash", "-euo", "pipefail", "-c", body] if lang == "bash" else [sys.executable, "-P"]
    done = subprocess.run(
        command,
        input=body if lang == "python" else None,
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    CHECKS[needle](folder, done.stdout)
