"""Claim: token2wav's window decode, the bound on streamed audio once the AR stages replay
graphs, gets several times faster with its DiT in bf16 and the whole window (the ODE
solve's 36 DiT passes and BigVGAN) replayed from one CUDA graph — with audio within the
bf16 tolerance of float32 (tests/backends/test_token2wav_graphs.py).

Decodes one window of `--frames` codes (60: two DiT blocks of context, one kept, two of
lookahead; 36: a stream's first window) for 1 and 10 requests at once, in each precision
(float32, transformers' own; tf32 matmuls; bf16 DiT), eagerly and from the static windows
(CUDA graphs; on CPU the same buffers solved eagerly, "static"), side by side: ms per
window, speed-up over float32 eager, and the audio's distance from float32 eager (max and
rms relative to the signal's). Ten requests replay a graph of 8 and one of 2 (GRAPH_BATCH).
Also: BigVGAN's own share (its eager forward on the same mel), the graphs' capture time,
and that timing them captured nothing more; on CUDA, how long a window's launch holds the
host, on an idle GPU and behind another window (`launch_ms`). `--kernels N` prints each
graph replay's and BigVGAN's N costliest kernels (CUDA only).

    python benchmarks/token2wav_window.py                          # tiny model, CPU
    python benchmarks/token2wav_window.py --device cuda --scaled 1  # real-size token2wav
    python benchmarks/token2wav_window.py --device cuda --scaled 1 --frames 36 --rows 1 \
        --precisions bfloat16 --kernels 20                         # what bounds a window
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from omniflow.backends.vocoders import Window, _Stream
from omniflow.catalog.resolve import model_path
from omniflow.families.qwen2_5_omni.checkpoints import scaled_token2wav
from omniflow.families.qwen2_5_omni.token2wav import Token2Wav
from omniflow.kernels.timing import kernel_table


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn, repeats: int):
    """Median seconds of `fn()` after one warm-up call, and its last result on the CPU."""
    fn()
    times, out = [], None
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = fn().float().cpu()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def launch_ms(fn) -> tuple[float, float]:
    """Host milliseconds `fn()` takes to return (its GPU work launched, not waited for) on an
    idle GPU, and called again at once, behind its own first call's work: a window's 11 graph
    replays return at once while the GPU's queue has room (served at c=32 they held the
    executor's loop: docs/benchmarks-log.md, "What holds the loop")."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    idle = time.perf_counter() - start
    fn()
    behind = time.perf_counter() - start - idle
    torch.cuda.synchronize()
    return idle * 1e3, behind * 1e3


def windows_of(decoder: Token2Wav, rows: int, frames: int) -> list[Window]:
    """`rows` requests' windows of the same codes (the same for every decoder), each request
    its own noise."""
    g = torch.Generator().manual_seed(frames)
    codes = torch.randint(0, decoder.codebook_size - 1, (frames, 1), generator=g)
    codes = codes.to(decoder.device)
    out = []
    for row in range(rows):
        state = decoder.open(SimpleNamespace(params={"seed": row}))
        side = decoder.side(state, frames).to(decoder.device)
        out.append(Window(_Stream(state, 0, codes, side), 0, frames, 0, frames))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--scaled", type=float, metavar="DEPTH")
    parser.add_argument("--frames", type=int, nargs="+", default=[60])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precisions", nargs="+")
    parser.add_argument("--kernels", type=int, default=0, metavar="N")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    precisions = args.precisions or (
        ["float32", "tf32", "bfloat16"] if cuda else ["float32", "bfloat16"]
    )
    static = "graphs" if cuda else "static"
    root = str(
        scaled_token2wav(args.scaled, args.device)
        if args.scaled
        else model_path("tiny:qwen2.5-omni")
    )
    torch.manual_seed(0)
    decoders = {}
    for precision in precisions:
        decoder = Token2Wav(root, args.device)
        decoder.set_precision(precision)
        start = time.perf_counter()
        try:
            decoder.prepare(args.frames, max(args.rows), capture=cuda)
        except Exception as err:  # one GPU run should still time the eager variants
            print(f"{precision}: static windows failed ({type(err).__name__}: {err}); eager only")
            decoder.graphs, decoder.batch_buckets, decoder.window_lengths = None, [], []
            decoders[precision] = decoder
            continue
        seconds = time.perf_counter() - start
        graphs = decoder.graphs
        windows = {key[:3] for key in graphs.keys()}  # noqa: SIM118 (Graphs is no dict)
        print(
            f"{precision}: {len(windows)} static windows (lengths "
            f"{args.frames}, batches {decoder.batch_buckets}) made in {seconds:.1f} s, "
            f"{graphs.captures} graphs captured"
        )
        decoders[precision] = decoder
    print(f"\n{root}, {args.device}, {args.repeats} repeats, median ms per window")
    print(
        f"{'codes':>5} {'requests':>8} {'variant':>16} {'ms':>9} {'speed-up':>9} "
        f"{'max diff':>9} {'rel rms':>8}"
    )
    for frames in args.frames:
        for rows in args.rows:
            base = None
            for precision, decoder in decoders.items():
                windows = windows_of(decoder, rows, frames)
                for mode, run in (("eager", decoder.decode_eager), (static, decoder.decode)):
                    with torch.inference_mode():
                        seconds, audio = timed(
                            args.device, lambda r=run, w=windows, f=frames: r(w, f), args.repeats
                        )
                    if base is None:
                        base = (seconds, audio)
                    diff = (audio - base[1]).abs().max()
                    rms = (audio - base[1]).pow(2).mean().sqrt() / base[1].pow(2).mean().sqrt()
                    print(
                        f"{frames:>5} {rows:>8} {precision + ' ' + mode:>16} "
                        f"{seconds * 1e3:>9.1f} {base[0] / seconds:>8.2f}x "
                        f"{float(diff):>9.1e} {float(rms):>8.1e}"
                    )
                if cuda and decoder.graphs is not None:
                    with torch.inference_mode():
                        idle, behind = launch_ms(
                            lambda d=decoder, w=windows, f=frames: d.decode(w, f)
                        )
                    print(f"{'':>31} launched in {idle:.2f} ms idle, {behind:.2f} ms behind one")
                if args.kernels and cuda:
                    with torch.inference_mode():
                        kernel_table(
                            lambda d=decoder, w=windows, f=frames: d.decode(w, f), args.kernels
                        )
            decoder = next(iter(decoders.values()))
            mel = torch.randn(rows, decoder.mel_dim, frames * decoder.repeats, device=args.device)
            with torch.inference_mode():
                seconds, _ = timed(args.device, lambda m=mel, d=decoder: d.bigvgan(m), args.repeats)
            print(f"{frames:>5} {rows:>8} {'bigvgan alone':>16} {seconds * 1e3:>9.1f}")
            if args.kernels and cuda:
                with torch.inference_mode():
                    kernel_table(lambda m=mel, d=decoder: d._vocode(m), args.kernels)
    for precision, decoder in decoders.items():
        if decoder.graphs is not None:
            graphs = decoder.graphs
            print(
                f"{precision}: {graphs.captures} captures at load, {graphs.replays} replays since"
            )


if __name__ == "__main__":
    main()
