"""Claim: Qwen3-TTS's frame step (the talker's decode step, its code predictor's 15
sub-steps and every sampling step of the frame) replayed from two CUDA graphs back to back,
the talker's step at its batch bucket (and length bucket, `--modes buckets`) and the frame's
finish at its batch bucket,
takes milliseconds at any batch up to 64, where the eager step (a DynamicCache and 15
predictor forwards with host work between them) is bound by the host.

Loads the talker stage of a real-size random-weight Qwen3-TTS-12Hz-1.7B-CustomVoice
(`omniflow models build-scaled`, built once into the cache; `--tiny`: the tiny checkpoint,
anywhere) through the transformers `ar` backend in each decode mode, prefills `batch`
requests together (the serving benchmark's text, speaker Vivian, the checkpoint's own
sampling: temperature 0.9, top-k 50, repetition penalty 1.05, the code predictor sampled
likewise), then times `--steps` decode steps on the host. Each step is one frame of every
request: `backend.step` returns with the frames of the step before on the host (static
paths, whose own step runs meanwhile) or its own (eager), so in a steady run its wall time
is the time of a frame. Also times the graph replays alone (CUDA events, no host work), the
step's (both graphs) and the first step's (`StaticDecoder.first`: a prefill's first tokens
and frames, the finish alone, which the prefill's wall time includes: it waits for the
device).
A frame is 80 ms of audio: a step time t at batch b speaks b x 80 / t seconds of audio a
second.

    python benchmarks/tts_frames.py                      # on a GPU: eager and graphs, 1/16/64
    python benchmarks/tts_frames.py --tiny --modes eager static --batches 1 4 --steps 4
    python benchmarks/tts_frames.py --modes graphs buckets --max-len 4096   # attention by length
    python benchmarks/tts_frames.py --modes graphs --batches 1 64 --kernels 20  # what bounds it
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

# (appended: the tree's root first would put its kernels/ before PyPI's `kernels`, which
# transformers imports)
sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks.stage_steps import close_stage, replay_ms, step_when_ready, sync  # noqa: E402
from benchmarks.tts_serve import CUSTOM, TEXT  # noqa: E402
from omniflow.backends.static_decode import StaticDecoder  # noqa: E402
from omniflow.backends.transformers_ar import TransformersAR  # noqa: E402
from omniflow.compiler import compile_source  # noqa: E402
from omniflow.kernels.timing import kernel_table  # noqa: E402
from omniflow.runtime.stage import Call, InputStream, StageSpec  # noqa: E402

SOURCE = """
pipeline frames {{
  model {model}
  stage talker = ar(component="talker", max_batch={slots}, max_len={max_len}, max_tokens={frames},
                    language="English", decode="{decode}")
  input text: text -> talker
  input voice: text = "" -> talker.voice
  talker.codes -> output codes
}}
"""


def backend_for(model: str, mode: str, slots: int, frames: int, device: str, max_len: int):
    """The talker stage in decode `mode`; "buckets" is "graphs" with the step's attention
    over a length bucket, torch's SDPA (`StaticDecoder(bucketed=True)`: a step graph per
    batch and length bucket) instead of `decode_attention` reading each row's length on the
    device, its static decoder rebuilt so (from "static": nothing captured twice)."""
    decode = "static" if mode == "buckets" else mode
    source = SOURCE.format(
        model=f'"{model}"', slots=slots, frames=frames, decode=decode, max_len=max_len
    )
    plan = compile_source(source, devices="1xH200" if device.startswith("cuda") else "cpu")
    start = time.perf_counter()
    backend = TransformersAR(StageSpec.from_channels(plan.stage("talker"), plan.channels), device)
    if mode == "buckets":
        static, c = backend.static, backend.component
        static.close()
        backend.static = StaticDecoder(
            c, slots=static.slots, columns=static.columns, device=device,
            capture=device.startswith("cuda"), extra=static.has_extra, frames=c.frame_spec,
            bucketed=True,
        )  # fmt: skip
    sync(device)
    return backend, time.perf_counter() - start


def new_calls(batch: int, frames: int, tag: str) -> list[Call]:
    calls = []
    for i in range(batch):
        text, voice = InputStream("text"), InputStream("text")
        text.push(TEXT, end=True)
        voice.push("Vivian", end=True)
        params = {"max_tokens": frames, "seed": i}
        calls.append(Call(f"{tag}-{batch}-{i}", params, {"prompt": text, "voice": voice}))
    return calls


def frame_times(
    backend: TransformersAR, batch: int, steps: int, frames: int, kernels: int = 0
) -> tuple:
    """Wall ms of the prefill of `batch` requests together (their first frames included),
    the median wall ms of a decode step over them, and of the step's and the first step's
    graph replays alone (None without graphs); with `kernels`, prints the step's replay's
    costliest kernels."""
    device = str(backend.device)
    calls = new_calls(batch, frames, "warm")  # a first prefill of the shape pays set-up
    backend.step(calls)
    for call in calls:
        backend.drop(call)
    calls = new_calls(batch, frames, "timed")
    static = backend.static
    before = static.dispatched.copy() if static is not None else None
    sync(device)
    start = time.perf_counter()
    backend.step(calls)  # prefill, and each request's first frame
    sync(device)
    prefill = (time.perf_counter() - start) * 1e3
    if kernels and static is not None:  # the prefill's graphs it replayed
        for kind, key in static.dispatched - before:
            if kind == "prefill" and key in static.prefill_graphs:
                print(f"  batch {batch}'s prefill at {key} (batch, width), replayed:")
                kernel_table(static.prefill_graphs[key][0].replay, kernels)
    times = []
    for step in range(3 + steps):  # 3 to warm up
        live = [c for c in calls if not c.finished]  # (the tiny checkpoint's speech ends)
        if not live:
            break
        start = time.perf_counter()
        step_when_ready(backend, live)
        if step >= 3:
            times.append(time.perf_counter() - start)
        for call in calls:
            call.emitted.clear()
    assert not any(c.error for c in calls), [c.error for c in calls]
    replay = first = None
    if static is not None and static.graphs:
        longest = max(s.length + s.ahead for s in backend.rows)
        buckets = static.buckets(len(backend.rows), longest)
        sync(device)
        with torch.inference_mode():  # (the static buffers are inference tensors)
            static.active.zero_()  # no row advances in the replays below
        replay = replay_ms(functools.partial(static.replay, *buckets))
        first = replay_ms(functools.partial(static.replay, buckets[0]))
        if kernels:
            print(f"  batch {batch}'s frame step, replayed (both graphs):")
            kernel_table(functools.partial(static.replay, *buckets), kernels)
    for call in calls:
        backend.drop(call)
    return prefill, statistics.median(times) * 1e3 if times else None, replay, first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["eager", "graphs"],
                        choices=["eager", "static", "graphs", "buckets"])  # fmt: skip
    parser.add_argument("--max-len", type=int, default=256, help="the talker's cache columns")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps")
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoint (any machine)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="print each replayed frame step's N costliest kernels")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    cuda = args.device.startswith("cuda")
    if args.tiny:
        model = "tiny:qwen3-tts-customvoice"
    else:
        from omniflow.checkpoints.scaled import scaled_checkpoint

        model = str(scaled_checkpoint(CUSTOM, 1.0, args.device))
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"Qwen3-TTS frame steps, {time.strftime('%Y-%m-%d %H:%M')}, {name}, {model}")
    slots, frames = max(args.batches), args.steps + 16
    rows = []
    for mode in args.modes:
        backend, load_s = backend_for(model, mode, slots, frames, args.device, args.max_len)
        static = backend.static
        note = f"{mode} ({backend.decode}): loaded in {load_s:.1f} s"
        if static is not None:
            note += (
                f", fused {static.fused}, {static.captures} graphs captured in "
                f"{static.capture_seconds:.1f} s, cache {static.slots} x {static.columns}"
            )
            if static.captures:  # what the capture ran, and saved against whole frame steps
                note += f"\n  capture ran {static.capture_work().line()}"
        print(note, flush=True)
        captured = static.captures if static is not None else 0
        for batch in args.batches:
            prefill, step, replay, first = frame_times(
                backend, batch, args.steps, frames, args.kernels
            )
            rows.append((mode, batch, prefill, step, replay, first))
            print(
                f"  batch {batch:>3}: prefill {prefill:8.1f} ms, frame {shown(step, 8)} ms"
                + (f", replay {replay:.2f} ms, first {first:.2f} ms" if replay else ""),
                flush=True,
            )
        close_stage(backend, captured, cuda)
    print(
        f"\n{'mode':>7} {'batch':>5} {'prefill ms':>10} {'frame ms':>9} {'replay ms':>9} "
        f"{'first ms':>9} {'audio-s/s':>9}"
    )
    for mode, batch, prefill, step, replay, first in rows:
        rate = batch * 80 / step if step else None
        cells = " ".join(shown(x, 9) for x in (step, replay, first, rate))
        print(f"{mode:>7} {batch:5d} {prefill:10.1f} {cells}")
    return 0


def shown(value: float | None, width: int) -> str:
    """A table cell: `value` to 2 places, or "-" where there is none (no timed frame: every
    stream of the tiny checkpoint ended first; no graph replayed)."""
    return f"{value:{width}.2f}" if value is not None else f"{'-':>{width}}"


if __name__ == "__main__":
    sys.exit(main())
