"""Benchmark: a GPU tensor across a process boundary on one GPU, side by side in one run.

For payloads of 4 KiB .. 256 MiB of a tensor on cuda:0:
- d2d: `dst.copy_(src)` in one process, back to back -- the bandwidth any one-copy path has
- cuda-ipc: omniflow's device ring, `DeviceProducer` in a spawned process -> `DeviceConsumer`
  here (one device-to-device copy into the consumer's GPU memory; views come out)
- shm: the host ring a GPU tensor took before device edges: a device-to-host copy into the
  ring, and the consumer's host-to-device copy to have it on its GPU again

A chunk has arrived when its bytes are on the consumer's GPU and the consumer's host knows
it: the device ring hands off on the GPU (stream-ordered), so the consumer synchronizes its
stream before stamping. Throughput streams `n` chunks back to back through a ring of 4
slots: bytes over the time from the producer's first put to the consumer's last arrival
(CLOCK_MONOTONIC, one clock for both processes; only the last chunk is synchronized, as a
consumer queueing GPU work on each would). Hand-off latency is one-way, for 4 KiB through a
ring of 2 slots with the producer pausing between puts so that the credit is back: 50 us
(the consumer still spins for the next chunk, as a busy pipeline's does) and 1 ms (it has
gone to sleep in poll, and the kernel must wake it); the producer stamps a message before
its put, the consumer subtracts the stamp once the chunk has arrived. For d2d it is one 4 KiB `copy_` and a synchronize.

    python benchmarks/device_edges.py            # on a GPU machine, about a minute
    python benchmarks/device_edges.py --quick    # up to 16 MiB, few iterations
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

from omniflow.runtime.device_ring import DeviceConsumer, DeviceProducer
from omniflow.runtime.doorbells import ChunkMeta
from omniflow.runtime.shm_ring import ShmConsumer, ShmProducer

KiB, MiB = 1 << 10, 1 << 20
SIZES = {4 * KiB: 4000, 64 * KiB: 3000, 1 * MiB: 1000, 16 * MiB: 200, 64 * MiB: 60, 256 * MiB: 20}
LATENCY_MESSAGES = 2000
RINGS = {"cuda-ipc": (DeviceConsumer, DeviceProducer), "shm": (ShmConsumer, ShmProducer)}
SPAWN = mp.get_context("spawn")


def _produce(kind: str, name: str, size: int, count: int, gap: float) -> None:
    producer = RINGS[kind][1].attach(name)
    src = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda:0")
    for i in range(count):
        _pause(gap)
        producer.put(src, ChunkMeta("bench", i, i == count - 1, time.monotonic_ns()), timeout=60)
    producer.put((), ChunkMeta("bench", count, True, 0), timeout=60)  # waits for the last credit
    producer.close()


def _pause(seconds: float) -> None:
    """Sleep, or under a millisecond spin: a sleep that short oversleeps by far more."""
    if seconds >= 1e-3:
        time.sleep(seconds)
        return
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def _ring(
    kind: str, slots: int, size: int, count: int, gap: float = 0.0, sync_each: bool = False
) -> list[tuple[int, int]]:
    """(sent, arrived) monotonic ns of each chunk through a ring of `kind`, the producer
    pausing `gap` s before each put; the consumer synchronizes on the last chunk, or on each."""
    if kind == "shm":
        consumer = ShmConsumer.create(slots, size)
    else:
        consumer = DeviceConsumer.create(slots, size, "cuda:0")
    peer = SPAWN.Process(target=_produce, args=(kind, consumer.name, size, count, gap))
    peer.start()
    times = []
    for i in range(count):
        got = consumer.get(timeout=120)
        tensor = got.tensors[0]
        if kind == "shm":
            tensor.to("cuda:0", non_blocking=False)  # the consumer needs it on its GPU
        if sync_each or i == count - 1:
            torch.cuda.current_stream().synchronize()
        arrived = time.monotonic_ns()
        times.append((got.meta.sent, arrived))
        got.release()
    consumer.get(timeout=60).release()
    peer.join(60)
    consumer.close()
    return times


def _d2d_bandwidth(size: int, count: int) -> float:
    src = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(count):
        dst.copy_(src)
    torch.cuda.synchronize()
    return size * count / (time.perf_counter() - start)


def _d2d_latency_us(size: int, count: int) -> list[float]:
    src = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    out = []
    for _ in range(count):
        start = time.perf_counter_ns()
        dst.copy_(src)
        torch.cuda.synchronize()
        out.append((time.perf_counter_ns() - start) / 1e3)
    return out


def _stream_bandwidth(kind: str, size: int, count: int) -> float:
    times = _ring(kind, 4, size, count)
    return size * count / ((times[-1][1] - times[0][0]) / 1e9)


def _p(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sizes = {s: max(n // 10, 5) for s, n in SIZES.items() if s <= 16 * MiB} if args.quick else SIZES
    latency_count = LATENCY_MESSAGES // 10 if args.quick else LATENCY_MESSAGES
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(
        f"{'payload':>9} {'d2d GB/s':>9} {'cuda-ipc':>9} {'shm':>9} {'ipc/d2d':>8} {'ipc/shm':>8}"
    )
    for size, count in sizes.items():
        d2d = _d2d_bandwidth(size, count)
        ipc = _stream_bandwidth("cuda-ipc", size, count)
        shm = _stream_bandwidth("shm", size, max(count // 4, 3))
        label = f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"
        print(
            f"{label:>9} {d2d / 1e9:9.1f} {ipc / 1e9:9.1f} {shm / 1e9:9.1f} "
            f"{ipc / d2d:7.2f}x {ipc / shm:7.2f}x"
        )
    print(f"\n4 KiB hand-off, put start to arrival, {latency_count} messages (us)")
    print(f"{'path':>9} {'consumer':>9} {'median':>8} {'p99':>8}")
    rows = {("d2d", "-"): _d2d_latency_us(4 * KiB, latency_count)}
    for kind in ("cuda-ipc", "shm"):
        # 50 us apart the consumer is still spinning for the next chunk; 1 ms apart it sleeps.
        for label, gap in (("spinning", 50e-6), ("asleep", 1e-3)):
            paced = _ring(kind, 2, 4 * KiB, latency_count, gap=gap, sync_each=True)
            rows[kind, label] = [(b - a) / 1e3 for a, b in paced]
    for (name, label), values in rows.items():
        print(f"{name:>9} {label:>9} {statistics.median(values):8.1f} {_p(values, 0.99):8.1f}")


if __name__ == "__main__":
    main()
