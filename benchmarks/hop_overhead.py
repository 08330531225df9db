"""Claim: a cross-process hop between executors costs well under 100 µs, and fusing stages
into one executor removes it.

Runs one-token requests through chains of 1, 2, 4 and 8 identity stages, once with every
edge fused (one executor) and once with every edge a process boundary (one executor per
stage), side by side in one run. Per-hop overhead = (unfused - fused) / (stage-to-stage
edges). Both variants also pay the frontend's two hops (input in, output out).

    python benchmarks/hop_overhead.py [--requests 300]
"""

from __future__ import annotations

import argparse
import statistics
import time

from omniflow.compiler import compile_source
from omniflow.runtime.engine import Engine

STAGE = "python(fn=omniflow.runtime.builtin_stages.identity, max_batch=1)"


def chain(n: int, fused: bool) -> str:
    # chunk=1 streams fuse; chunk=8 ones stay process boundaries (a one-token request is
    # flushed at its end either way).
    attrs = "[stream, chunk=1]" if fused else "[stream, chunk=8]"
    lines = [f"pipeline chain{n} {{"] + [f"  stage s{i} = {STAGE}" for i in range(n)]
    lines += ["  input x: tokens -> s0"]
    lines += [f"  s{i}.out -> s{i + 1}.in {attrs}" for i in range(n - 1)]
    lines += [f"  s{n - 1}.out -> output y [stream]", "}"]
    return "\n".join(lines)


def measure(n: int, fused: bool, requests: int) -> tuple[float, int]:
    plan = compile_source(chain(n, fused), "chain.omni")
    with Engine(plan, "process") as engine:
        for _ in range(20):
            engine.generate({"x": [1]})
        times = []
        for _ in range(requests):
            start = time.perf_counter()
            engine.generate({"x": [1]})
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6, len(plan.executors)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    print(
        f"{'stages':>6} {'fused µs':>9} {'exec':>4} {'unfused µs':>11} {'exec':>4} {'unfused/fused':>14} {'per hop µs':>11}"
    )
    for n in (1, 2, 4, 8):
        fused, fx = measure(n, True, args.requests)
        unfused, ux = measure(n, False, args.requests)
        hop = (unfused - fused) / (n - 1) if n > 1 else float("nan")
        print(
            f"{n:>6} {fused:>9.0f} {fx:>4} {unfused:>11.0f} {ux:>4} {unfused / fused:>14.2f} {hop:>11.0f}"
        )
    print(
        f"(median request latency of {args.requests} one-token requests; 'per hop' = extra latency per process boundary)"
    )


if __name__ == "__main__":
    main()
