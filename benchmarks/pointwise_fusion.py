"""Claim: a map chain fused into one generated Triton kernel beats running its ops one by one.

Prints, per tensor size, the time of the op-by-op torch chain (what an unfused pipeline
does), of torch.compile on the same chain, and of our generated kernel, with ratios, all
measured side by side in one run. Needs a CUDA GPU.

    python benchmarks/pointwise_fusion.py
"""

from __future__ import annotations

import argparse

import torch

from omniflow.kernels.pointwise import _TORCH_NS, chain_expression, fused, reference
from omniflow.kernels.pointwise_ops import chain_out_dtype

CHAINS = {
    "audio: gain|clamp|pcm16": (("gain", (0.9,)), ("clamp", (-1, 1)), ("pcm16", ())),
    "image: denorm|to_uint8": (("denorm", ()), ("to_uint8", ())),
    "5 ops: tanh|sigmoid|offset|abs|relu": (
        ("tanh", ()),
        ("sigmoid", ()),
        ("offset", (1.5,)),
        ("abs", ()),
        ("relu", ()),
    ),
}


def as_torch_function(chain) -> callable:
    """The chain as a plain function of torch ops (what torch.compile can trace and fuse)."""
    out = chain_out_dtype("float32", list(chain))
    return eval(
        f"lambda x: ({chain_expression(chain)}).to(torch.{out})", {**_TORCH_NS, "torch": torch}
    )  # noqa: S307


def _time_ms(fn, x, iters: int) -> float:
    for _ in range(3):
        fn(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn(x)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU: the fused kernel only runs on GPUs; nothing to compare")
        return
    print(f"device: {torch.cuda.get_device_name()}  (median of {args.iters} runs)")
    header = f"{'chain':38} {'elements':>10} {'op-by-op ms':>12} {'compile ms':>11} {'fused ms':>9} {'vs op-by-op':>12} {'vs compile':>11}"
    print(header)
    print("-" * len(header))
    for label, chain in CHAINS.items():
        compiled = torch.compile(as_torch_function(chain))
        for n in (1 << 16, 1 << 20, 1 << 24, 1 << 26):
            x = torch.randn(n, device="cuda")
            unfused = _time_ms(lambda t, c=chain: reference(t, c), x, args.iters)
            comp = _time_ms(compiled, x, args.iters)
            ours = _time_ms(lambda t, c=chain: fused(t, c), x, args.iters)
            print(
                f"{label:38} {n:>10} {unfused:>12.4f} {comp:>11.4f} {ours:>9.4f} {unfused / ours:>11.2f}x {comp / ours:>10.2f}x"
            )


if __name__ == "__main__":
    main()
