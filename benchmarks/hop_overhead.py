"""Claim: a cross-process hop between executors costs well under 100 µs, and fusing stages
into one executor removes it.

Runs one-token requests through chains of 1, 2, 4 and 8 identity stages, once with every
edge fused (one executor) and once with every edge a process boundary (one executor per
stage), side by side in one run. Per-hop overhead = (unfused - fused) / (stage-to-stage
edges). Both variants also pay the frontend's two hops (input in, output out).

Besides latency it reports the CPU time a request costs every process of the run (this one,
with the engine's I/O thread, and the executors): work off a request's critical path does
not lengthen it while cores are free, but it is still what a busy server runs out of.

    python benchmarks/hop_overhead.py [--requests 300] [--stages 1 2 4 8]
    python benchmarks/hop_overhead.py --profile [--rounds 20] [--stages 1 4 8]   # on vs off

`--profile` measures instead what profiling costs (issue: <= 2 % of request latency): the
same chains, each on one engine, in rounds alternating profiled and not
(`profile_overhead.py`), and the profiled/unprofiled latency ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from profile_overhead import interleaved, off_cost_ns, ratio_rows

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


def cpu_seconds(pids: list[int]) -> float:
    """Time these processes (every thread of them) have run on a CPU, from the scheduler's
    nanosecond counters."""
    total = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def measure(n: int, fused: bool, requests: int) -> tuple[float, float, int]:
    """Median request latency (µs), CPU time per request (µs), executors."""
    plan = compile_source(chain(n, fused), "chain.omni")
    with Engine(plan, "process") as engine:
        for _ in range(20):
            engine.generate({"x": [1]})
        pids = [os.getpid(), *engine.executor_pids.values()]
        cpu_before = cpu_seconds(pids)
        times = []
        for _ in range(requests):
            start = time.perf_counter()
            engine.generate({"x": [1]})
            times.append(time.perf_counter() - start)
        cpu = (cpu_seconds(pids) - cpu_before) / requests
    return statistics.median(times) * 1e6, cpu * 1e6, len(plan.executors)


def timed_requests(engine: Engine, requests: int) -> dict[str, list[float]]:
    times = []
    for _ in range(requests):
        start = time.perf_counter()
        engine.generate({"x": [1]})
        times.append(time.perf_counter() - start)
    return {"latency": times}


def profile_overhead(chains: list[int], rounds: int, per_round: int) -> None:
    print(
        f"{'stages':>6} {'exec':>4} {'off µs':>8} {'on µs':>8} {'on/off':>7}"
        f" {'events/req':>10} {'off-site cost ns':>16} {'of latency':>10}"
    )
    for n in chains:
        for fused in (True, False):
            plan = compile_source(chain(n, fused), "chain.omni")
            with Engine(plan, "process") as engine:
                timed_requests(engine, 20)  # warm up
                samples, recorded = interleaved(
                    engine, lambda e=engine: timed_requests(e, per_round), rounds
                )
            ((_, off, on),) = ratio_rows(samples)
            per_request = recorded / (rounds * per_round)
            bound = off_cost_ns(per_request)
            print(
                f"{n:>6} {len(plan.executors):>4} {off * 1e6:>8.0f} {on * 1e6:>8.0f}"
                f" {on / off:>7.3f} {per_request:>10.1f} {bound:>16.0f} {bound / (off * 1e9):>10.4%}"
            )
    print(
        f"(median latency of {rounds} x {per_round} one-token requests each way, rounds "
        "alternating on/off; 'off-site cost' bounds what the recording sites cost a loop "
        "that is not profiled: one `is not None` test per event a profiled request records)"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--stages", type=int, nargs="+", help="chain lengths (1 2 4 8; 1 4 8)")
    parser.add_argument("--profile", action="store_true", help="measure profiling on vs off")
    parser.add_argument("--rounds", type=int, default=20, help="with --profile: rounds each way")
    args = parser.parse_args()
    if args.profile:
        profile_overhead(
            args.stages or [1, 4, 8], args.rounds, max(1, args.requests // args.rounds)
        )
        return
    print(
        f"{'stages':>6} {'fused µs':>9} {'cpu µs':>7} {'exec':>4} {'unfused µs':>11} {'cpu µs':>7}"
        f" {'exec':>4} {'unfused/fused':>14} {'per hop µs':>11} {'per hop cpu µs':>15}"
    )
    for n in args.stages or [1, 2, 4, 8]:
        fused, fused_cpu, fx = measure(n, True, args.requests)
        unfused, unfused_cpu, ux = measure(n, False, args.requests)
        hop = (unfused - fused) / (n - 1) if n > 1 else float("nan")
        hop_cpu = (unfused_cpu - fused_cpu) / (n - 1) if n > 1 else float("nan")
        print(
            f"{n:>6} {fused:>9.0f} {fused_cpu:>7.0f} {fx:>4} {unfused:>11.0f} {unfused_cpu:>7.0f}"
            f" {ux:>4} {unfused / fused:>14.2f} {hop:>11.0f} {hop_cpu:>15.0f}"
        )
    print(
        f"(median request latency of {args.requests} one-token requests; 'cpu' = CPU time per "
        "request of this process and the executors; 'per hop' = extra per process boundary)"
    )


if __name__ == "__main__":
    main()
