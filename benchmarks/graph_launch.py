"""Claim under test: replaying a captured CUDA graph returns to the host at once, whatever is
queued before it, so a stage that replays graphs never holds its executor's loop for the
GPU's time.

Served, it does not hold: at c=32 omni chat's code2wav steps spent 519 of 610 sampled ticks
inside `CUDAGraph.replay` of token2wav's RK4 step graph (docs/benchmarks-log.md, "What holds
the loop: token2wav's graph replays"). This measures the host milliseconds a sequence of
replays takes to return, beside the GPU milliseconds they run, in the situations a served
process has: one heavy graph replayed back to back, two alternating, a graph of 1,300 small
kernels (a DiT step's count) back to back or queued behind a heavy one, N distinct
executables of one graph (instantiated with the driver), and each of those on a stream of
the highest priority (the stage nearest the listener's) while another stream keeps the GPU
busy. Needs a CUDA GPU. (Found: none of them blocks; served, the GPU was 83-97 % busy, so
the replays waited for room in its queue: docs/benchmarks-log.md, "The replays wait for a
GPU kept busy".)

    python benchmarks/graph_launch.py
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch


def capture(fn, keep: bool = False) -> torch.cuda.CUDAGraph:
    """`fn` captured on a side stream after one eager run (`keep`: its cudaGraph_t kept, for
    more executables)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph(keep_graph=keep)
    with torch.cuda.graph(graph):
        fn()
    if keep:
        graph.instantiate()
    torch.cuda.synchronize()
    return graph


class DriverExec:
    """Another executable of a kept graph (`cuGraphInstantiateWithFlags`), launched on the
    current stream with `cuGraphLaunch`."""

    driver = None

    def __init__(self, graph: torch.cuda.CUDAGraph):
        if DriverExec.driver is None:
            DriverExec.driver = ctypes.CDLL("libcuda.so.1")
        self.exec = ctypes.c_void_p()
        raw = ctypes.c_void_p(graph.raw_cuda_graph())
        result = self.driver.cuGraphInstantiateWithFlags(
            ctypes.byref(self.exec), raw, ctypes.c_ulonglong(0)
        )
        if result:
            raise RuntimeError(f"cuGraphInstantiateWithFlags failed: {result}")

    def replay(self) -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        if self.driver.cuGraphLaunch(self.exec, stream):
            raise RuntimeError("cuGraphLaunch failed")


def timed(launches) -> tuple[float, float, list[float]]:
    """Host ms for `launches` to return, GPU ms they run, and each launch's host ms."""
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    start, each = time.perf_counter(), []
    for graph in launches:
        mark = time.perf_counter()
        graph.replay()
        each.append((time.perf_counter() - mark) * 1e3)
    host = (time.perf_counter() - start) * 1e3
    end.record()
    torch.cuda.synchronize()
    return host, begin.elapsed_time(end), each


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out, small = torch.empty_like(a), torch.zeros(1024, device="cuda")

    def heavy():  # ~7 ms of matmuls, 40 kernels
        for _ in range(40):
            torch.matmul(a, a, out=out)

    def many_small():  # 1,300 kernels of ~1 us
        for _ in range(1300):
            small.add_(1.0)

    big, big2, tiny, tiny2 = (
        capture(heavy),
        capture(heavy),
        capture(many_small),
        capture(many_small),
    )
    kept = capture(heavy, keep=True)
    execs = [kept, *(DriverExec(kept) for _ in range(8))]
    cases = {
        "heavy x1": [big],
        "heavy, the same executable x9": [big] * 9,
        "heavy, two executables alternating x9": [big, big2] * 4 + [big],
        "heavy, 9 executables of one graph": execs,
        "1,300 small kernels x1": [tiny],
        "1,300 small kernels, the same x9": [tiny] * 9,
        "heavy, then 1,300 small kernels x9": [big] + [tiny] * 9,
        "heavy, then two small alternating x9": [big] + [tiny, tiny2] * 4 + [tiny],
    }
    urgent = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])
    other = torch.cuda.Stream()
    print(f"{torch.cuda.get_device_name()}: host ms for the replays to return, GPU ms they run")
    print(f"{'replays':<40} {'where':<22} {'host ms':>8} {'GPU ms':>8}  each launch, host ms")
    for _ in range(args.repeats):
        for label, launches in cases.items():
            for where in ("default stream", "urgent, other busy"):
                if where == "default stream":
                    host, gpu, each = timed(launches)
                else:
                    with torch.cuda.stream(other):
                        for _ in range(20):
                            heavy()  # ~140 ms of work on another stream
                    with torch.cuda.stream(urgent):
                        host, gpu, each = timed(launches)
                shown = " ".join(f"{ms:.2f}" for ms in each[:10])
                print(f"{label:<40} {where:<22} {host:>8.2f} {gpu:>8.2f}  {shown}")


if __name__ == "__main__":
    main()
