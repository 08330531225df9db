"""Claim: code2wav's step (the 12 Hz speech tokenizer's causal decoder, each stream's state
carried in its slot) replayed from a CUDA graph per (batch bucket, window length) costs its
kernels' time, where the eager step, a stack of ~300 small conv and transformer kernels
launched one by one, is bound by the host at ~20-30 ms whatever its window
(tests/backends/test_code2wav_graphs.py: the replay is the eager step's audio and the whole
decode's).

Loads code2wav of a real-size random-weight Qwen3-TTS-12Hz-1.7B-CustomVoice (built once into
the cache, as benchmarks/tts_frames.py's talker; `--tiny`: the tiny checkpoint, anywhere)
twice, eager and with static windows (`--windows` frames at the batch buckets up to the
largest `--batches`: CUDA graphs on a GPU, the same buffers run eagerly on the CPU,
"static"), and times `decoder.step` (host work included: what a served step pays) for each
batch and window: `batch` streams in their own slots, `--position` frames into their
utterances (the attention's window full), new codes each call. Prints ms per step, the
speed-up, audio seconds a second of decoding (each frame is 80 ms), and the largest
difference between the two modes' audio (they run the same calls from the same zero
states). Timing reuses benchmarks/token2wav_window.py's `timed`.

    python benchmarks/code2wav_step.py                        # on a GPU, real size
    python benchmarks/code2wav_step.py --tiny --device cpu --batches 1 4 --windows 1 4
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks.token2wav_window import timed  # noqa: E402
from omniflow.backends.vocoders import Window, _Stream  # noqa: E402
from omniflow.catalog.resolve import model_path  # noqa: E402
from omniflow.families.qwen3_tts.code2wav import Code2Wav, load  # noqa: E402

CUSTOM = "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"


def decoder_for(root: str, device: str, slots: int, windows: list[int], static: bool):
    """code2wav with `slots` state slots, and static windows of `windows` frames if
    `static` (captured on CUDA); and the seconds it took to make them."""
    decoder = load(root, "code2wav", device)
    decoder.init_states(slots)
    start = time.perf_counter()
    if static:
        decoder.prepare(windows, slots, capture=device.startswith("cuda"))
    return decoder, time.perf_counter() - start


def stepper(decoder: Code2Wav, batch: int, frames: int, position: int):
    """A step of `batch` streams' windows of `frames` new random codes, `position` frames in."""
    g = torch.Generator().manual_seed(batch * 1000 + frames)
    top = decoder.codebook_size

    def step() -> torch.Tensor:
        windows = []
        for _ in range(batch):
            codes = torch.randint(0, top, (frames, decoder.num_codebooks), generator=g)
            stream = _Stream({}, 0, codes.to(decoder.device))
            windows.append(Window(stream, 0, frames, 0, frames))
        with torch.inference_mode():
            return decoder.step(list(range(batch)), [position] * batch, windows, frames)

    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoint (any machine)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--position", type=int, default=100, help="frames decoded before")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cuda = args.device.startswith("cuda")
    if args.tiny:
        root = str(model_path("tiny:qwen3-tts-customvoice"))
    else:
        from omniflow.checkpoints.scaled import scaled_checkpoint

        root = str(scaled_checkpoint(CUSTOM, 1.0, args.device))
    static = "graphs" if cuda else "static"
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"code2wav steps, {time.strftime('%Y-%m-%d %H:%M')}, {name}, {root}")
    slots = max(args.batches)
    eager, _ = decoder_for(root, args.device, slots, args.windows, static=False)
    fast, made_s = decoder_for(root, args.device, slots, args.windows, static=True)
    graphs = fast.graphs
    print(
        f"{static}: {len(graphs.keys())} static windows (frames {args.windows}, batches "
        f"{fast.batch_buckets}) made in {made_s:.1f} s, {graphs.captures} captured"
    )
    captured = graphs.captures
    print(
        f"\n{'batch':>5} {'window':>6} {'eager ms':>9} {static + ' ms':>10} {'speed-up':>9} "
        f"{'audio-s/s':>10} {'max diff':>9}"
    )
    for batch in args.batches:
        for frames in args.windows:
            slow_s, slow_audio = timed(
                args.device, stepper(eager, batch, frames, args.position), args.repeats
            )
            fast_s, fast_audio = timed(
                args.device, stepper(fast, batch, frames, args.position), args.repeats
            )
            replayed = (fast.batch_bucket(batch), frames) in graphs
            print(
                f"{batch:>5} {frames:>6} {slow_s * 1e3:>9.2f} {fast_s * 1e3:>10.2f}"
                f"{'' if replayed else '*'} {slow_s / fast_s:>8.2f}x "
                f"{batch * frames * 0.08 / fast_s:>10.1f} "
                f"{float((fast_audio - slow_audio).abs().max()):>9.1e}",
                flush=True,
            )
    assert graphs.captures == captured, "timing the steps captured graphs"
    print(f"{static}: {graphs.captures} captures at load, {graphs.replays} replays since")
    print("(* no static window of that shape: the same forward eagerly)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
