"""Python stages the server tests serve (imported by dotted path in executor processes).

`words` answers a chat with the last user message's words, one per step; a message
containing `crash` kills its executor, `fail` fails its request, `many N` emits N words
one every 5 ms (a request that lasts until it is cancelled), `wait S` answers `done` after
S seconds. Waiting yields (other requests take their turns), it never sleeps the loop.
`edit` inverts an image; `hear` says how much audio it was given and how long the chat is;
`reel` makes four grey frames of a video, or fails when its prompt says `fail`; `speak`
says 10 ms of silence a word, and fails after its first word's when its text says `fail`.
"""

import os
import time

import torch


def _text(message) -> str:
    content = message.get("content") or ""
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content)
    return content


def words(call):
    chat = yield from call.read_all("prompt")
    text = _text(chat[-1])
    if "crash" in text:
        os._exit(3)
    if "fail" in text:
        raise ValueError("failing as asked")
    parts = text.split()
    if len(parts) == 2 and parts[0] == "many":
        for i in range(int(parts[1])):
            call.emit("text", f"w{i} ")
            yield from _pause(0.005)
        return
    if len(parts) == 2 and parts[0] == "wait":
        yield from _pause(float(parts[1]))
        parts = ["done"]
    for word in parts:
        call.emit("text", word + " ")
        yield


def _pause(seconds: float):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        yield


def speak(call):
    """A text -> 10 ms of silence a word (int16 samples at 24 kHz, the default rate of a
    pipeline's audio); a text with `fail` fails after its first word's audio."""
    text = yield from call.read_all("text")
    for index, _ in enumerate(text.split()):
        if index and "fail" in text:
            raise ValueError("failing as asked")
        call.emit("audio", torch.zeros(1, 240, dtype=torch.int16))  # one step of 240
        yield


def edit(batch):
    """An image and a prompt -> the image inverted (the prompt must not be empty)."""
    out = []
    for item in batch:
        if not item["prompt"].strip():
            raise ValueError("empty prompt")
        image = item["image"]
        out.append({"out": (255 - image.to(torch.uint8))[None]})
    return out


def hear(batch):
    """A chat and its audio -> "heard N samples, M messages" (N: the audio's samples)."""
    return [
        {"text": f"heard {item['audio'].numel()} samples, {len(item['prompt'])} messages"}
        for item in batch
    ]


def reel(call):
    """A prompt -> a video of four 16 x 16 grey frames; a prompt with `fail` fails."""
    prompt = yield from call.read_all("prompt")
    if "fail" in prompt:
        raise ValueError("failing as asked")
    call.emit("video", torch.full((1, 4, 16, 16, 3), 128, dtype=torch.uint8))
    yield
