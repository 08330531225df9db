"""Claim: sampling a decode step's tokens in one fused Triton kernel beats the torch reference
(sort-based filtering, batched) and the per-row loop the transformers backend runs today.

Per batch size B (V = 152064, Qwen's vocabulary) and per workload, prints the median time of
one decode step's sampling with its ids read back to the host, for the per-row loop
(`TransformersAR._advance`: penalty, `_warp`, softmax, `torch.multinomial` row by row), the
batched torch reference (`omniflow.kernels.sampling.reference`) and the fused kernel, with
ratios, all measured side by side in one run. Needs a CUDA GPU.

    python benchmarks/sampling.py
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

WORKLOADS = {
    "qwen defaults": {},  # temperature 0.7, top-k 20, top-p 0.8, repetition penalty 1.05
    "top-p 0.95 only": {"top_k": -1, "top_p": 0.95},
    "greedy": {"temperature": 0.0},
}


def per_row(logits, seen, params, generators) -> list[int]:
    """What `TransformersAR._advance` does for each row, one after another."""
    from omniflow.backends.transformers_ar import Sampling, _warp

    chosen = []
    for i, row in enumerate(logits):
        penalty = params.penalty[i].item()
        sampling = Sampling(
            params.temperature[i].item(),
            params.top_p[i].item(),
            params.top_k[i].item(),
            penalty,
            1,
            None,
            frozenset(),
            (),
        )
        row = torch.where(seen[i], torch.where(row < 0, row * penalty, row / penalty), row)
        if sampling.temperature == 0:
            chosen.append(row.argmax())
        else:
            probs = _warp(row, sampling).softmax(-1)
            chosen.append(torch.multinomial(probs, 1, generator=generators[i])[0])
    return torch.stack(chosen).tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--vocab", type=int, default=152064)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU: the fused sampler only runs on GPUs; nothing to compare")
        return
    from omniflow.kernels.sampling import benchmark, benchmark_inputs
    from omniflow.kernels.timing import cuda_median_ms

    print(
        f"device: {torch.cuda.get_device_name()}  V={args.vocab}  "
        f"(median of {args.iters} runs; each: one step's ids on the host)"
    )
    header = (
        f"{'workload':16} {'B':>3} {'per-row ms':>11} {'torch ms':>9} {'fused ms':>9} "
        f"{'vs torch':>9} {'vs per-row':>11}"
    )
    print(header)
    print("-" * len(header))
    for label, settings in WORKLOADS.items():
        for rows in (1, 8, 32):
            logits, seen, params = benchmark_inputs(rows, args.vocab, **settings)
            generators = [torch.Generator("cuda").manual_seed(i) for i in range(rows)]
            loop = cuda_median_ms(partial(per_row, logits, seen, params, generators), args.iters)
            times = benchmark(rows, args.vocab, args.iters, **settings)
            batched, fused = times["torch"], times["triton"]
            print(
                f"{label:16} {rows:>3} {loop:>11.3f} {batched:>9.3f} {fused:>9.3f} "
                f"{batched / fused:>8.1f}x {loop / fused:>10.1f}x"
            )


if __name__ == "__main__":
    main()
