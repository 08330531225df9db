"""Claim: compiling stays fast as pipelines grow (target: < 1 s at 200 stages).

Generates pipelines of N stages — a chain of small LMs streaming hidden states per token,
with every fifth stage also feeding a python post-processor that reaches its own output —
and times each phase (parse, build, passes, lower) side by side in one run.

    python benchmarks/compile_scale.py
"""

from __future__ import annotations

import statistics
import time

from omniflow.compiler import optimize
from omniflow.dsl.parser import parse
from omniflow.ir.from_ast import build
from omniflow.lower import lower


def generate(n: int) -> str:
    lines = ["pipeline scale {", '  model "Qwen/Qwen2.5-0.5B-Instruct"', "  param max_tokens = 64"]
    for i in range(n):
        if i % 5 == 4:
            lines.append(f'  stage s{i} = python(fn=user.post, inputs="hidden", outputs="text")')
        else:
            lines.append(f"  stage s{i} = ar(max_batch=2, max_len=256, max_tokens=$max_tokens)")
    lines.append("  input prompt: chat -> s0")
    prev = "s0"
    for i in range(1, n):
        if i % 5 == 4:
            lines.append(f"  {prev}.hidden -> s{i}.hidden [stream, chunk=4]")
            lines.append(f"  s{i}.text -> output out{i} [stream]")
        else:
            lines.append(f"  {prev}.hidden -> s{i}.embeds [stream, chunk=1]")
            prev = f"s{i}"
    lines.append(f"  {prev}.text -> output text [stream]")
    return "\n".join(lines + ["}"])


def main() -> None:
    devices = "8xH100"
    print(
        f"{'stages':>6} {'parse ms':>9} {'build ms':>9} {'passes ms':>10} {'lower ms':>9} {'total ms':>9} {'per stage ms':>13}"
    )
    for n in (10, 50, 200):
        text = generate(n)
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            program = parse(text, "scale.omni")
            t1 = time.perf_counter()
            graph = build(program)
            t2 = time.perf_counter()
            optimized = optimize(graph, devices)
            t3 = time.perf_counter()
            lower(optimized)
            t4 = time.perf_counter()
            runs.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0))
        med = [statistics.median(r[i] for r in runs) * 1e3 for i in range(5)]
        print(
            f"{n:>6} {med[0]:>9.1f} {med[1]:>9.1f} {med[2]:>10.1f} {med[3]:>9.1f} {med[4]:>9.1f} {med[4] / n:>13.2f}"
        )
    print(f"(median of 5 runs each; devices {devices})")


if __name__ == "__main__":
    main()
