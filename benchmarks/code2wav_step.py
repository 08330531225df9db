"""Claim: code2wav's step (a causal decoder, each stream's state carried in its slot:
Qwen3-TTS's 12 Hz speech tokenizer, or Qwen3-Omni's code2wav, `--family`) replayed from a
CUDA graph per (batch bucket, window length) costs its kernels' time, where the eager step,
a stack of ~300 small conv and transformer kernels launched one by one, is bound by the host
at ~20-30 ms whatever its window (tests/backends/test_code2wav_graphs.py,
tests/families/test_qwen3_omni_code2wav.py: the replay is the eager step's audio and the
whole decode's).

Loads code2wav twice, eager and with static windows (`--windows` frames at the batch buckets
up to the largest `--batches`: CUDA graphs on a GPU, the same buffers run eagerly on the
CPU, "static"), in `--precision`, and times `decoder.step` (host work included: what a
served step pays) for each batch and window: `batch` streams in their own slots,
`--position` frames into their utterances (the attention's window full), new codes each
call. Prints ms per step, the speed-up, audio seconds a second of decoding (each frame is
80 ms), and the largest difference between the two modes' audio (they run the same calls
from the same zero states). Timing reuses benchmarks/token2wav_window.py's `timed`.
The decoder: qwen3-tts, a real-size random-weight Qwen3-TTS-12Hz-1.7B-CustomVoice (built
once into the cache, as benchmarks/tts_frames.py's talker); qwen3-omni, code2wav at the
published Qwen3-Omni-30B-A3B config (`scaled_config`), random weights, built in memory;
`--tiny`: the tiny checkpoint, anywhere.

    python benchmarks/code2wav_step.py                        # on a GPU, real size
    python benchmarks/code2wav_step.py --family qwen3-omni --precision bfloat16  # as served
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
from omniflow.backends.carried_state import StatefulDecoder  # noqa: E402
from omniflow.backends.vocoders import Window, _Stream  # noqa: E402
from omniflow.catalog.resolve import model_path  # noqa: E402

CUSTOM = "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"
FAMILIES = ("qwen3-tts", "qwen3-omni")


def load_code2wav(family: str, tiny: bool, device: str) -> StatefulDecoder:
    """The family's code2wav on `device`: tiny, or at its real size with random weights
    (the same weights at every call)."""
    if family == "qwen3-tts":
        from omniflow.families.qwen3_tts.code2wav import load

        if tiny:
            return load(str(model_path("tiny:qwen3-tts-customvoice")), "code2wav", device)
        from omniflow.checkpoints.scaled import scaled_checkpoint

        return load(str(scaled_checkpoint(CUSTOM, 1.0, device)), "code2wav", device)
    from omniflow.families.qwen3_omni.code2wav import Code2Wav, load

    if tiny:
        return load(str(model_path("tiny:qwen3-omni")), "code2wav", device)
    from transformers import Qwen3OmniMoeCode2Wav

    from omniflow.families.qwen3_omni.scaled import scaled_config

    config = scaled_config(1.0)[0].code2wav_config
    torch.manual_seed(0)
    return Code2Wav(Qwen3OmniMoeCode2Wav(config).float(), device)


def decoder_for(args, slots: int, static: bool) -> tuple[StatefulDecoder, float]:
    """code2wav with `slots` state slots in `args.precision`, and static windows of
    `args.windows` frames if `static` (captured on CUDA); and the seconds they took."""
    decoder = load_code2wav(args.family, args.tiny, args.device)
    decoder.set_precision(args.precision)
    decoder.init_states(slots)
    start = time.perf_counter()
    if static:
        decoder.prepare(args.windows, slots, capture=args.device.startswith("cuda"))
    return decoder, time.perf_counter() - start


def stepper(decoder: StatefulDecoder, batch: int, frames: int, position: int):
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
    parser.add_argument("--family", choices=FAMILIES, default="qwen3-tts")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="float32", help="bfloat16: qwen3-omni as served")
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoint (any machine)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--position", type=int, default=100, help="frames decoded before")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cuda = args.device.startswith("cuda")
    static = "graphs" if cuda else "static"
    name = torch.cuda.get_device_name() if cuda else "cpu"
    size = "tiny" if args.tiny else "real size"
    print(f"{args.family} code2wav steps, {time.strftime('%Y-%m-%d %H:%M')}, {name}, {size}")
    slots = max(args.batches)
    eager, _ = decoder_for(args, slots, static=False)
    fast, made_s = decoder_for(args, slots, static=True)
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
