"""Hostile and careless media, replayed against one real `omniflow run` server (issue 41):
what a request can make the server read, decode or run, answered with a 4xx naming the
field in well under a second, the server's memory and `/health` unmoved, no traceback in
its log, nothing left in /dev/shm or its temp dir when it stops.

- local paths: read only under `--allowed-media-dir`; a link out of it, a FIFO in it, a
  process's descriptors (/proc/self/fd), devices and files elsewhere all get one answer,
  at once, whatever the reason (no oracle, no thread blocked);
- decompression bombs (an 8-channel 1000 s silent FLAC, 13000 x 13000 and 14000 x 14000
  PNGs, a video over the pixel limit) refused from what they declare, before decoding;
- fields a stage would refuse (an image size off the patch, a video width of 33, a clip
  too short for the speaker encoder) refused at admission; `x_vector_only_mode` clones;
- a chunked body over `--max-body-bytes` is a 413 with its reason; a voice name with a
  control character a 400.

One server: the Base (voice clone) Qwen3-TTS graph, text-to-image, text-to-video, omni chat
and the edit pipeline, tiny, in one process, with its own temp dir.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import statistics
import threading
import time
from http.client import HTTPConnection
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile
import torch
from PIL import Image

from omniflow.media import mp4_bytes
from tests.server.conftest import GRAPHS, HERE, ServerProcess

RATE = 24000
SPEECH = "/v1/audio/speech"
VOICES = "/v1/audio/voices"
CHAT = "/v1/chat/completions"
CLONE = "qwen3_tts_clone"
MAX_BODY = 2 << 20
MAX_VIDEO_PIXELS = 32 * 32 * 12  # a 32 x 32 clip of 12 frames at most
# How much a refused request may raise the server's peak memory (a bomb decoded: GBs).
MEMORY_BOUND_MB = 100
REFUSED = "no media file this server may read at that path"


# --- the files a request names ----------------------------------------------------------------
def wav(seconds: float) -> bytes:
    t = np.arange(int(RATE * seconds)) / RATE
    samples = (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, RATE, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def silent_flac(seconds: int, channels: int = 8, rate: int = 16000) -> bytes:
    """A few hundred KB that declare (and hold) `seconds` of `channels`-channel silence."""
    buffer = io.BytesIO()
    block = np.zeros((rate * 50, channels), np.int16)
    with soundfile.SoundFile(buffer, "w", rate, channels, format="FLAC") as flac:
        for _ in range(seconds // 50):
            flac.write(block)
    return buffer.getvalue()


def flat_png(side: int) -> bytes:
    """A 1-bit PNG of one colour, `side` x `side`: some 20 KB however large it declares."""
    buffer = io.BytesIO()
    Image.new("1", (side, side)).save(buffer, "PNG")
    return buffer.getvalue()


def small_png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buffer, "PNG")
    return buffer.getvalue()


def data_uri(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """An allowed folder (a clip, an image, a link out of it, a FIFO) and a clip outside."""
    allowed = tmp_path_factory.mktemp("allowed")
    outside = tmp_path_factory.mktemp("outside") / "secret.wav"
    outside.write_bytes(wav(1.0))
    (allowed / "ref.wav").write_bytes(wav(1.0))
    (allowed / "image.png").write_bytes(small_png())
    (allowed / "link.wav").symlink_to(outside)
    os.mkfifo(allowed / "pipe.wav")
    return {"allowed": allowed, "outside": outside}


def clone_graph(folder: Path) -> str:
    """graphs/qwen3_tts.omni on the Base checkpoint, as tests/server/test_qwen3_tts_serving
    serves it."""
    source = (GRAPHS / "qwen3_tts.omni").read_text()
    source = source.replace("1.7B-CustomVoice", "1.7B-Base").replace(
        "pipeline qwen3_tts", f"pipeline {CLONE}"
    )
    path = folder / f"{CLONE}.omni"
    path.write_text(source)
    return str(path)


@pytest.fixture(scope="module")
def server(files, tmp_path_factory):
    folder = tmp_path_factory.mktemp("graphs")
    temp = tmp_path_factory.mktemp("server-tmp")
    graphs = [clone_graph(folder), *(str(GRAPHS / f"{n}.omni") for n in
              ("text_to_image", "text_to_video", "omni_chat")), str(HERE / "edit.omni")]  # fmt: skip
    small = ["--param", "max_tokens=6", "--param", "steps=2", "--param", "num_frames=5",
             *(f"--param={p}.{side}=32" for p in ("text_to_image", "text_to_video")
               for side in ("height", "width"))]  # fmt: skip
    server = ServerProcess(
        [
            *graphs,
            "--tiny",
            "--mode",
            "inprocess",
            *small,
            "--allowed-media-dir",
            str(files["allowed"]),
            "--max-body-bytes",
            str(MAX_BODY),
            "--max-video-pixels",
            str(MAX_VIDEO_PIXELS),
        ],  # fmt: skip
        env={"TMPDIR": str(temp)},
    )
    yield server
    server.stop_cleanly()
    # torch keeps its compile cache in the temp dir, on purpose; nothing else may stay.
    assert [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor")] == []


@pytest.fixture(scope="module")
def http(server):
    with server.client() as client:
        yield client


class Watch:
    """The server's health as a refused request leaves it: how long the refusal took, how
    long /health takes after it, and how far its peak memory rose meanwhile (the peak is
    reset before each request where the kernel lets us: /proc/PID/clear_refs)."""

    def __init__(self, server: ServerProcess, http: httpx.Client):
        self.pid, self.http = server.proc.pid, http
        baseline = []
        for _ in range(5):  # a 4xx that does no work, for the time bound
            began = time.perf_counter()
            assert http.post(CHAT, json={"model": "nope"}).status_code == 404
            baseline.append(time.perf_counter() - began)
        self.bound_s = max(1.0, 20 * statistics.median(baseline))

    def _status(self, key: str) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) // 1024
        raise AssertionError(f"no {key} for {self.pid}")

    def _reset_peak(self) -> None:
        # Where the kernel refuses, the peak is the process's whole-life one: a looser check.
        with contextlib.suppress(OSError):
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")

    def refused(self, method: str, path: str, param: str, status: int = 400, **kwargs) -> str:
        """Send a request that must be refused with `status` naming `param`; its message."""
        self._reset_peak()
        before = self._status("VmRSS")
        began = time.perf_counter()
        reply = self.http.request(method, path, **kwargs)
        took = time.perf_counter() - began
        assert reply.status_code == status, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and error["message"], error
        assert took < self.bound_s, f"{took:.2f} s for a {status}: {error['message']}"
        grew = self._status("VmHWM") - before
        assert grew < MEMORY_BOUND_MB, f"peak memory rose {grew} MB: {error['message']}"
        self.healthy()
        return error["message"]

    def healthy(self) -> None:
        began = time.perf_counter()
        assert self.http.get("/health").status_code == 200
        assert time.perf_counter() - began < self.bound_s


@pytest.fixture(scope="module")
def watch(server, http):
    return Watch(server, http)


def speech(ref_audio: str, **fields) -> dict:
    body = {"model": CLONE, "input": "Hi.", "x_vector_only_mode": True, "ref_audio": ref_audio}
    return {"json": {**body, **fields}}


def chat(part: dict) -> dict:
    content = [part, {"type": "text", "text": "What is in there?"}]
    body = {"model": "omni_chat", "max_tokens": 2, "modalities": ["text"],
            "messages": [{"role": "user", "content": content}]}  # fmt: skip
    return {"json": body}


# --- local paths ------------------------------------------------------------------------------
def test_a_file_in_an_allowed_dir_is_read(http, files):
    allowed = files["allowed"]
    for ref in (str(allowed / "ref.wav"), f"file://{allowed / 'ref.wav'}"):
        reply = http.post(SPEECH, **speech(ref, response_format="pcm"))
        assert reply.status_code == 200 and reply.content, reply.text
    image = {"type": "image_url", "image_url": {"url": str(allowed / "image.png")}}
    assert http.post(CHAT, **chat(image)).status_code == 200


def test_every_other_path_gets_one_answer_at_once(watch, files):
    """A link out, a FIFO (which would block an open for ever), a way out by '..', a
    process's descriptor, a device, a shared-memory name, a file elsewhere, a missing file
    inside and outside: the same text, naming the field, each in well under a second."""
    allowed, outside = files["allowed"], files["outside"]
    paths = [
        str(allowed / "link.wav"),
        str(allowed / "pipe.wav"),
        f"{allowed}/../{outside.parent.name}/{outside.name}",
        "/proc/self/fd/1",
        "/proc/self/environ",
        "/dev/zero",
        "/dev/shm/omniflow-0-0",
        str(outside),
        "/etc/passwd",
        str(allowed / "missing.wav"),
        "/root/.ssh/id_rsa",
        f"file://{outside}",
        f"file://example.com{allowed / 'ref.wav'}",
        "../" * 8 + "etc/passwd",
    ]
    messages = {path: watch.refused("POST", SPEECH, "ref_audio", **speech(path)) for path in paths}
    assert len(set(messages.values())) == 1, messages
    assert REFUSED in messages[paths[0]]


@pytest.mark.parametrize("kind", ["image_url", "audio_url", "video_url"])
def test_chat_media_parts_refuse_paths_too(watch, kind):
    where = f"messages[0].content[0].{kind}"
    message = watch.refused(
        "POST", CHAT, where, **chat({"type": kind, kind: {"url": "/etc/hosts"}})
    )
    assert REFUSED in message


def test_requests_on_a_fifo_block_no_thread(watch, http, files):
    """Seven such requests froze the server's thread pool: voice uploads hung, SIGTERM no
    longer stopped it. Twenty at once, then the server goes on serving."""
    fifo = str(files["allowed"] / "pipe.wav")
    statuses = []

    def send() -> None:
        with httpx.Client(base_url=http.base_url, timeout=30) as own:
            statuses.append(own.post(SPEECH, **speech(fifo)).status_code)

    threads = [threading.Thread(target=send) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert statuses == [400] * 20
    watch.healthy()
    files_ = {"audio": ("ref.wav", wav(1.0), "audio/wav")}
    reply = http.post(VOICES, data={"name": "after-fifo", "model": CLONE}, files=files_)
    assert reply.status_code == 201, reply.text
    assert http.delete(f"{VOICES}/after-fifo", params={"model": CLONE}).status_code == 200


# --- decompression bombs ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def flac_bomb() -> bytes:
    return silent_flac(1000)


def test_an_audio_bomb_is_refused_from_its_header(watch, flac_bomb):
    assert len(flac_bomb) < MAX_BODY // 2
    upload = {"audio": ("bomb.flac", flac_bomb, "audio/flac")}
    message = watch.refused("POST", VOICES, "audio", data={"name": "bomb", "model": CLONE},
                            files=upload)  # fmt: skip
    assert "1000.0 s" in message and "at most 60 s" in message
    watch.refused("POST", SPEECH, "ref_audio", **speech(data_uri("audio/flac", flac_bomb)))
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(flac_bomb).decode()}}
    message = watch.refused("POST", CHAT, "messages[0].content[0].input_audio", **chat(part))
    assert "1000.0 s" in message


@pytest.mark.parametrize("side", [13000, 14000])  # 14000: past Pillow's own bomb limit
def test_an_image_bomb_is_refused_from_its_header(watch, side):
    bomb = flat_png(side)
    assert len(bomb) < 64 << 10
    upload = {"input_reference": ("bomb.png", bomb, "image/png")}
    message = watch.refused("POST", "/v1/videos", "input_reference",
                            data={"model": "text_to_video", "prompt": "x"}, files=upload)  # fmt: skip
    assert "pixels" in message
    watch.refused("POST", "/v1/images/edits", "image", data={"model": "edit", "prompt": "x"},
                  files={"image": ("bomb.png", bomb, "image/png")})  # fmt: skip
    part = {"type": "image_url", "image_url": {"url": data_uri("image/png", bomb)}}
    watch.refused("POST", CHAT, "messages[0].content[0].image_url", **chat(part))


def test_a_video_over_the_pixel_limit_is_refused_from_its_header(watch):
    frames = torch.zeros(40, 32, 32, 3, dtype=torch.uint8)
    part = {"type": "video_url", "video_url": {"url": data_uri("video/mp4", mp4_bytes(frames, 8))}}
    message = watch.refused("POST", CHAT, "messages[0].content[0].video_url", **chat(part))
    assert f"at most {MAX_VIDEO_PIXELS}" in message


# --- fields a stage would refuse --------------------------------------------------------------
def test_an_image_size_off_the_patch_is_a_400(watch):
    body = {"model": "text_to_image", "prompt": "x", "size": "250x250"}
    message = watch.refused("POST", "/v1/images/generations", "size", json=body)
    assert "multiple of 16" in message


def test_a_picture_past_the_processors_aspect_ratio_is_a_400(watch):
    """Qwen2-VL's image processor takes up to 200:1 (what it refused in the vision stage
    was a 500); an image of 1 x 201 pixels is refused at admission, one of 1 x 200 runs."""

    def part(width: int, height: int) -> dict:
        buffer = io.BytesIO()
        Image.new("RGB", (width, height), (90, 20, 200)).save(buffer, "PNG")
        return {"type": "image_url", "image_url": {"url": data_uri("image/png", buffer.getvalue())}}

    for width, height in ((201, 1), (1, 201)):
        message = watch.refused(
            "POST", CHAT, "messages[0].content[0].image_url", **chat(part(width, height))
        )
        assert f"{width} x {height} pixels" in message and "up to 200:1" in message
    assert watch.http.post(CHAT, **chat(part(200, 1))).status_code == 200
    # A video goes on as its file: its header's size is what is checked.
    frames = torch.zeros(4, 2, 404, 3, dtype=torch.uint8)
    video = {"type": "video_url", "video_url": {"url": data_uri("video/mp4", mp4_bytes(frames, 8))}}
    message = watch.refused("POST", CHAT, "messages[0].content[0].video_url", **chat(video))
    assert "404 x 2 pixels" in message and "up to 200:1" in message


def test_chat_media_a_stage_would_fail_on_are_a_400(watch, http):
    """What reached a stage and failed there as a 500, or was refused in another's words: a
    video of one frame, a clip at 1 Hz, a WAV sent as a video, a clip of 10 ms. A float
    clip far past full scale is clipped as a player would, not an overflow in the talker."""

    def part(kind: str, data: bytes) -> dict:
        if kind == "input_audio":
            return {"type": kind, kind: {"data": base64.b64encode(data).decode(), "format": "wav"}}
        return {"type": kind, kind: {"url": data_uri("video/mp4", data)}}

    def float_wav(samples: np.ndarray, rate: int) -> bytes:
        buffer = io.BytesIO()
        soundfile.write(buffer, samples.astype(np.float32), rate, format="WAV", subtype="FLOAT")
        return buffer.getvalue()

    video, audio = "messages[0].content[0].video_url", "messages[0].content[0].input_audio"
    one_frame = mp4_bytes(torch.zeros(1, 32, 32, 3, dtype=torch.uint8), 8)
    message = watch.refused("POST", CHAT, video, **chat(part("video_url", one_frame)))
    assert "1 frame" in message and "image_url" in message
    message = watch.refused(
        "POST", CHAT, audio, **chat(part("input_audio", float_wav(np.zeros(10), 1)))
    )
    assert "1 Hz" in message
    message = watch.refused("POST", CHAT, video, **chat(part("video_url", wav(1.0))))
    assert "no video stream" in message
    message = watch.refused("POST", CHAT, audio, **chat(part("input_audio", wav(0.01))))
    assert "at least 25 ms" in message
    loud = float_wav(np.full(16000, 1e30), 16000)
    assert http.post(CHAT, **chat(part("input_audio", loud))).status_code == 200


def test_a_video_width_off_the_patch_is_a_400_at_submission(watch, http):
    before = http.get("/v1/videos").json()["data"]
    fields = {"model": "text_to_video", "prompt": "x", "width": "33"}
    for path in ("/v1/videos", "/v1/videos/sync"):
        watch.refused("POST", path, "width", data=fields)
        watch.refused("POST", path, "width", json={**fields, "width": 33})
    assert http.get("/v1/videos").json()["data"] == before  # no job was made


def test_a_clip_too_short_to_encode_is_a_400_and_the_connection_stays(server, watch, http):
    short = data_uri("audio/wav", wav(0.02))
    message = watch.refused("POST", SPEECH, "ref_audio", **speech(short))
    assert "20 ms" in message
    files_ = {"audio": ("short.wav", wav(0.02), "audio/wav")}
    watch.refused("POST", VOICES, "audio", data={"name": "short", "model": CLONE}, files=files_)
    host, port = server.base.removeprefix("http://").split(":")
    connection = HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", SPEECH, json.dumps(speech(short)["json"]),
                       {"Content-Type": "application/json"})  # fmt: skip
    reply = connection.getresponse()
    reply.read()
    socket = connection.sock
    assert reply.status == 400 and socket is not None
    assert (reply.getheader("connection") or "").lower() != "close"
    connection.request("GET", "/health")
    again = connection.getresponse()
    again.read()
    assert again.status == 200 and connection.sock is socket  # the same connection
    connection.close()
    # Just over the encoder's least (53 ms) clones.
    reply = http.post(SPEECH, **speech(data_uri("audio/wav", wav(0.06))))
    assert reply.status_code == 200, reply.text


def test_x_vector_only_mode_clones(http):
    """The speaker embedding alone, no codes, no transcript: inline, streamed, and from an
    uploaded voice; what it says differs from an ICL clone of the same clip and seed."""
    ref = data_uri("audio/wav", wav(1.5))
    body = speech(ref, seed=7, response_format="pcm")["json"]
    alone = http.post(SPEECH, json=body)
    assert alone.status_code == 200 and alone.content, alone.text
    assert http.post(SPEECH, json={**body, "ref_text": "Hello there."}).content == alone.content
    icl = http.post(SPEECH, json={**body, "x_vector_only_mode": False, "ref_text": "Hello there."})
    assert icl.status_code == 200 and icl.content != alone.content
    streamed = http.post(SPEECH, json={**body, "stream": True})
    assert streamed.status_code == 200 and streamed.content == alone.content
    upload = {"audio": ("ref.wav", wav(1.5), "audio/wav")}
    assert http.post(VOICES, data={"name": "xvec", "model": CLONE}, files=upload).status_code == 201
    named = {**body, "ref_audio": None, "voice": "xvec"}
    reply = http.post(SPEECH, json=named)
    assert reply.status_code == 200 and reply.content == alone.content
    assert http.delete(f"{VOICES}/xvec", params={"model": CLONE}).status_code == 200


# --- bodies and names -------------------------------------------------------------------------
def test_a_chunked_body_over_the_limit_is_a_413_with_its_reason(watch):
    def chunks():
        yield b'--b\r\nContent-Disposition: form-data; name="audio"; filename="a.wav"\r\n\r\n'
        for _ in range(MAX_BODY // (1 << 16) + 8):
            yield bytes(1 << 16)

    headers = {"content-type": "multipart/form-data; boundary=b"}
    reply = watch.http.post(VOICES, content=chunks(), headers=headers)
    assert reply.status_code == 413, reply.text
    assert f"limit of {MAX_BODY} bytes" in reply.json()["error"]["message"]
    watch.healthy()


@pytest.mark.parametrize("name", ["bob\n", "bob\r", "bo\tb", "bob\x00"])
def test_a_voice_name_with_a_control_character_is_a_400(watch, name):
    upload = {"audio": ("ref.wav", wav(1.0), "audio/wav")}
    watch.refused("POST", VOICES, "name", data={"name": name, "model": CLONE}, files=upload)


@pytest.mark.parametrize("fields", [("audio", "audio"), ("audio", "file")])
def test_a_voice_upload_of_two_clips_is_a_400(watch, http, fields):
    """One clip an upload: of two, the last was taken without a word."""
    files = [(field, (f"{i}.wav", wav(1.0), "audio/wav")) for i, field in enumerate(fields)]
    message = watch.refused(
        "POST", VOICES, fields[1], data={"name": "twice", "model": CLONE}, files=files
    )
    assert "given twice" in message
    assert "twice" not in [v["name"] for v in http.get(VOICES).json()["data"]]
