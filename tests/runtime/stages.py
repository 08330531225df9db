"""Python stages the runtime tests run in executor processes (imported there by dotted path).

Delays come from OMNIFLOW_TEST_DELAY (seconds per step), set by a test before it launches.
"""

import os
import time

import torch


def _delay() -> float:
    return float(os.environ.get("OMNIFLOW_TEST_DELAY", "0"))


def counter(call):
    """`n` (text: a count) -> tokens 0..n-1, one step at a time."""
    text = yield from call.read_all("n")
    for i in range(int(text.split()[0])):
        call.emit("out", torch.tensor([[i]], dtype=torch.int64))
        time.sleep(_delay())
        yield


def double(call):
    """tokens -> tokens x 2, chunk by chunk, `_delay()` per step."""
    while (chunk := (yield from call.read("in"))) is not None:
        time.sleep(_delay() * chunk.shape[0])
        call.emit("out", chunk * 2)
        yield


def fail_on_boom(batch):
    """text -> text; a prompt containing 'boom' raises."""
    out = []
    for item in batch:
        if "boom" in item["in"]:
            raise ValueError(f"boom in {item['in']!r}")
        out.append({"out": item["in"].upper()})
    return out


def silent(batch):
    """text -> nothing: a stage whose output stream ends without a value."""
    return [{} for _ in batch]


def widen(call):
    """tokens -> tokens; a request whose first token is 99 emits one step far wider than the
    channel's item (a payload no ring slot planned for)."""
    while (chunk := (yield from call.read("in"))) is not None:
        call.emit(
            "out", torch.zeros(1, 1 << 20, dtype=torch.int64) if int(chunk[0, 0]) == 99 else chunk
        )
        yield


def ticker(call):
    """`n` (text: a count) -> the text "tick " n times, one step at a time, `_delay()` each."""
    text = yield from call.read_all("n")
    for _ in range(int(text.split()[0])):
        call.emit("out", "tick ")
        time.sleep(_delay())
        yield


def late_on_gpu(call):
    """`n` (text: a count) -> tokens 0..n-1 on the GPU, one a step, each written by a kernel
    queued behind a long GPU sleep: a consumer on another stream that did not wait for it
    would read the tensor before it was written."""
    text = yield from call.read_all("n")
    for i in range(int(text.split()[0])):
        value = torch.empty(1, 1, dtype=torch.int64, device="cuda")
        torch.cuda._sleep(2_000_000)  # a few ms of GPU time, queued on the stage's stream
        value.fill_(i)
        call.emit("out", value)
        yield


def break_gpu_on_boom(batch):
    """text -> text, upper-cased; a prompt containing 'boom' reads far out of bounds on the
    GPU: a device-side assert, which leaves the process's CUDA context unusable."""
    out = []
    for item in batch:
        if "boom" in item["in"]:
            far = torch.tensor([1 << 30], device="cuda")
            torch.zeros(1, device="cuda")[far].cpu()
        out.append({"out": item["in"].upper()})
    return out


def sync_when_asked(batch):
    """text -> text, upper-cased; a prompt containing 'sync' reads a value back from the GPU
    (the CPU where there is none) with `.item()`, a host sync."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = []
    for item in batch:
        if "sync" in item["in"]:
            torch.ones(1, device=device).sum().item()
        out.append({"out": item["in"].upper()})
    return out


def join(batch):
    """texts `a` and `b` -> "a b"."""
    return [{"out": f"{item['a']} {item['b']}"} for item in batch]
