"""Where a served run's time went, from py-spy's raw output (`scripts/gpu_session.sh` with
SPY=1: `py-spy record --subprocesses --idle --format raw`, every process of the run).

Prints each process's samples; then, for the executor processes, the samples in each
stage's step (`StageRunner.step` -> the backend's step) and outside them (waiting, loading);
then, under one backend's step (`--step`, default `Vocoder.step`), the leaf frames and the
chains of frames below the step that held it. With `--idle` sampled, a thread blocked in a
call (a CUDA launch waiting for room, a host sync) shows as that call's Python line.

    python scripts/spy_summary.py out/load.spy.gz --step Vocoder.step
"""

from __future__ import annotations

import argparse
import gzip
from collections import Counter

RUNNER_STEP = "StageRunner.step"


def name(frame: str) -> str:
    """`Vocoder.step (omniflow/backends/vocoders.py:560)` -> `Vocoder.step`."""
    return frame.split(" (")[0]


def summarise(path: str, step: str, rows: int) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    processes, steps, leaves, chains = Counter(), Counter(), Counter(), Counter()
    with opener(path, "rt") as lines:
        for line in lines:
            stack, _, count = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            owners = [f for f in frames if f.startswith("process ")]
            frames = [f for f in frames if not f.startswith("process ")]
            process = owners[-1] if owners else "?"
            processes[process[:100]] += int(count)
            if "omniflow.runtime.executor" not in process:
                continue
            names = [name(f) for f in frames]
            if RUNNER_STEP not in names:
                steps["(outside a step) " + (names[-1] if names else "?")] += int(count)
                continue
            below = names.index(RUNNER_STEP) + 1
            steps[names[below] if below < len(names) else "?"] += int(count)
            if step in names:
                at = names.index(step)
                leaves[frames[-1]] += int(count)
                chains[" > ".join(names[at + 1 :])] += int(count)
    print("samples by process")
    for process, count in processes.most_common():
        print(f"{count:8d}  {process}")
    print("\nexecutors: samples by stage step (and outside the steps)")
    for key, count in steps.most_common(rows):
        print(f"{count:8d}  {key}")
    print(f"\n{step}: leaf frames")
    for key, count in leaves.most_common(rows):
        print(f"{count:8d}  {key}")
    print(f"\n{step}: the frames below it")
    for key, count in chains.most_common(rows):
        print(f"{count:8d}  {key}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="py-spy's raw output (.spy or .spy.gz)")
    parser.add_argument("--step", default="Vocoder.step", help="the backend step to open up")
    parser.add_argument("--rows", type=int, default=15)
    args = parser.parse_args()
    summarise(args.path, args.step, args.rows)


if __name__ == "__main__":
    main()
