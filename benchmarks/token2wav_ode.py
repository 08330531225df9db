"""Claim: token2wav's flow-matching sampler, written without host-side comparisons of
device tensors, decodes a window faster than transformers' `RungeKutta4ODESolver`, which
waits for the GPU at every ODE step — with the same numbers.

Decodes one 60-code window (two DiT blocks of context, one block kept, two of lookahead:
what the streaming vocoder decodes per unit) for 1 and 10 requests at once, with each
solver, side by side.

    python benchmarks/token2wav_ode.py                          # tiny model, CPU
    python benchmarks/token2wav_ode.py --device cuda --scaled 1  # real-size token2wav
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

from omniflow.backends.vocoders import Window, _Stream
from omniflow.catalog.resolve import model_path
from omniflow.checkpoints.scaled import scaled_checkpoint
from omniflow.families.qwen2_5_omni.checkpoints import REAL_OMNI
from omniflow.families.qwen2_5_omni.token2wav import Token2Wav


def transformers_solve(decoder: Token2Wav):
    """The decoder's window solve with transformers' `RungeKutta4ODESolver` for its steps."""

    def solve(steps, **inputs):
        state = decoder._begin(steps=steps, **inputs)
        velocity = lambda t, value: decoder._velocity(state, t, value)  # noqa: E731
        state["value"] = RungeKutta4ODESolver(velocity, state["value"]).integrate(state["time"])[-1]
        return decoder._end(state)

    return solve


def timed_decode(decoder: Token2Wav, windows: list[Window], frames: int, repeats: int):
    times, audio = [], None
    for _ in range(repeats):
        if decoder.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            audio = decoder.decode(windows, frames).cpu()
        times.append(time.perf_counter() - start)
    return statistics.median(times), audio


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--scaled", type=float, metavar="DEPTH")
    parser.add_argument("--frames", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    root = scaled_checkpoint(REAL_OMNI, args.scaled, args.device) if args.scaled else None
    decoder = Token2Wav(str(root or model_path("tiny:qwen2.5-omni")), args.device)
    state = decoder.open(SimpleNamespace(params={}))
    codes = torch.randint(0, decoder.codebook_size - 1, (args.frames, 1), device=args.device)
    side = decoder.side(state, args.frames).to(args.device)
    stream = _Stream(state, 0, codes, side)
    print(
        f"{'requests':>8} {'transformers ms':>16} {'sync-free ms':>13} {'speed-up':>9} {'max diff':>9}"
    )
    for rows in (1, 10):
        windows = [Window(stream, 0, args.frames, 0, args.frames) for _ in range(rows)]
        results = {}
        for name, solve in (("transformers", transformers_solve(decoder)), ("sync-free", None)):
            if solve is not None:
                decoder._solve = solve
            timed_decode(decoder, windows, args.frames, 1)  # warm up
            results[name] = timed_decode(decoder, windows, args.frames, args.repeats)
            vars(decoder).pop("_solve", None)
        (old, old_audio), (new, new_audio) = results["transformers"], results["sync-free"]
        diff = float((old_audio - new_audio).abs().max())
        print(f"{rows:>8} {old * 1e3:>16.1f} {new * 1e3:>13.1f} {old / new:>8.2f}x {diff:>9.1e}")


if __name__ == "__main__":
    main()
