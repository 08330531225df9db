"""Stand-in stages: deterministic functions with each kind's real ports, types and shapes.

They let the runtime, the examples and the benchmarks run without model weights. Each is
chunking-invariant — its outputs do not depend on how its input streams were chunked — so
the reference interpreter, in-process and multi-process runs must agree exactly.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable
from functools import partial

import torch

from omniflow.dtypes import torch_dtype
from omniflow.runtime.python_backend import function_backend
from omniflow.runtime.stage import Backend, Call, StageSpec


def seed_of(*values) -> int:
    """A stable 63-bit hash of strings, tensors and JSON-like values."""
    h = hashlib.sha256()
    for v in values:
        if torch.is_tensor(v):
            h.update(v.contiguous().view(torch.uint8).numpy().tobytes() if v.numel() else b"")
        else:
            h.update(repr(v).encode())
    return int.from_bytes(h.digest()[:8], "little") >> 1


def _pattern(shape: tuple[int, ...], key: int, dtype: str) -> torch.Tensor:
    """A deterministic tensor in [-1, 1] that depends on `key` (elementwise, so exact everywhere)."""
    n = 1
    for d in shape:
        n *= d
    x = torch.arange(n, dtype=torch.float64) * 0.001 + (key % 10007) * 0.01
    return torch.sin(x).reshape(shape).to(torch_dtype(dtype))


def _param(call: Call, spec: StageSpec, key: str, default):
    value = call.params.get(key, default)
    return default if value is None else value


def ar(spec: StageSpec, call: Call):
    """Tokens, text pieces, hidden rows and codec frames, one step at a time; a stage fed an
    `embeds` stream makes one step per embedding it receives (a talker)."""
    whole = []
    for port in sorted(call.inputs):
        if port != "embeds":
            whole.append((yield from call.read_all(port)))
    seed = seed_of(*whole)
    max_tokens = _param(call, spec, "max_tokens", 2048)

    def emit(key: int) -> None:
        outs = spec.outputs
        key %= 1 << 31
        token = key % 997
        if "tokens" in outs:
            call.emit("tokens", torch.tensor([[token]], dtype=torch.int64))
        if "text" in outs:
            call.emit("text", f"w{token} ")
        if "hidden" in outs:
            call.emit("hidden", _pattern(outs["hidden"].shape, key, outs["hidden"].dtype)[None])
        if "codes" in outs:
            q = outs["codes"].shape[0]
            call.emit("codes", ((torch.arange(q) * 31 + key) % 1024)[None].to(torch.int64))

    if "embeds" not in call.inputs:
        for i in range(min(max_tokens, 3 + seed % 8)):
            emit(seed_of(seed, i))
            yield
        return
    i = 0
    while i < max_tokens:
        chunk = yield from call.read("embeds")
        if chunk is None:
            return
        for row in chunk[: max_tokens - i]:
            emit(seed_of(seed, row, i))
            i += 1
        yield


def encoder(spec: StageSpec, call: Call):
    """A variable-length sequence of hidden rows derived from all inputs."""
    values = []
    for port in sorted(call.inputs):
        values.append((yield from call.read_all(port)))
    out = spec.outputs["hidden"]
    seed = seed_of(*values)
    rows = 1 + seed % min(8, out.shape[0])
    call.emit("hidden", _pattern((rows, out.shape[1]), seed, out.dtype)[None])


def diffusion(spec: StageSpec, call: Call):
    """`steps` denoising steps from noise seeded by the conditioning (and an edit's input
    image) towards the conditioning's mean, one per step()."""
    cond = yield from call.read_all("cond")
    images = [(yield from call.read_all("image"))] if "image" in call.inputs else []
    out = spec.outputs["latents"]
    x = _pattern(out.shape, seed_of(cond, *images), "float32")
    target = cond.float().mean()
    for _ in range(_param(call, spec, "steps", 50)):
        x = x * 0.5 + target * 0.5
        yield
    call.emit("latents", x[None])


def vae(spec: StageSpec, call: Call):
    """Latents upsampled to pixels in [-1, 1]: an image, or a video's frames (each latent
    frame repeated over the frames it stands for)."""
    latents = (yield from call.read_all("latents"))[0]
    port = "video" if "video" in spec.outputs else "image"
    *frames, height, width, _ = spec.outputs[port].shape
    plane = latents.mean(dim=0)  # [h, w], or a video's [F', h, w]
    scale_h, scale_w = height // plane.shape[-2], width // plane.shape[-1]
    plane = plane.repeat_interleave(scale_h, -2).repeat_interleave(scale_w, -1)
    if frames:
        index = torch.linspace(0, plane.shape[0] - 1, frames[0]).round().long()
        plane = plane[index]
    image = torch.stack([torch.tanh(plane + k) for k in (0.0, 0.25, 0.5)], dim=-1)
    call.emit(port, image[None])


def vocoder(spec: StageSpec, call: Call):
    """Per frame, samples depending on that frame and `context` frames before it (as a real
    vocoder with left context does), decoded chunk by chunk as frames arrive."""
    port = "codes" if "codes" in call.inputs else "hidden"
    context = spec.contexts.get(port, 0)
    samples = spec.outputs["audio"].shape[0]
    history: deque[int] = deque(maxlen=context + 1)
    t = torch.arange(samples, dtype=torch.float64)
    while True:
        chunk = yield from call.read(port)
        if chunk is None:
            return
        frames = []
        for frame in chunk:
            history.append(
                int(frame.to(torch.int64).sum()) if port == "codes" else seed_of(frame) % 4096
            )
            window = sum(history)
            frames.append(torch.sin(t * 0.01 * (1 + window % 50)) * 0.5)
        call.emit("audio", torch.stack(frames).to(torch.float32))
        yield


STANDINS: dict[str, Callable] = {
    "ar": ar,
    "encoder": encoder,
    "diffusion": diffusion,
    "vae": vae,
    "vocoder": vocoder,
}


def standin_backend(spec: StageSpec, device: str) -> Backend:
    """The stand-in for `spec`'s kind (a python stage runs its own function)."""
    from omniflow.runtime.python_backend import python_backend

    if spec.plan.kind == "python":
        return python_backend(spec, device)
    return function_backend(spec, device, partial(STANDINS[spec.plan.kind], spec))
