"""Claim: a `net` edge (zmq over TCP into pre-allocated slots) carries chunks between nodes
at a usable fraction of the shm ring's rate, and an executor in a Ray actor costs about what
a plain executor process costs per hop. Side by side in one run:

1. One edge, producer in a spawned process: the net ring on loopback vs the shm ring.
   Throughput streams chunks back to back through a ring of 4 slots (bytes over the time
   from the first put to the last arrival); latency is a 4 KiB message's one-way time
   through a ring of one slot, the producer waiting on a side pipe for the consumer's
   go-ahead before stamping each message, so every message meets an idle channel. Beside
   them, Ray's own way of moving a tensor to an actor: a method call taking it (`ray call`:
   calls issued back to back, bytes over the time until the last returned; latency half a
   call's round trip) -- the alternative to a net ring that the design weighed.
2. Hop overhead: one-token requests through a chain of 2 identity stages, one executor per
   stage (edges between them chunked, so never fused), run as plain executor processes
   (`process`), as Ray actors on one node (`ray`, shm edges: what Ray adds is the actor and
   the control plane over TCP) and as Ray actors spread over two simulated nodes (`ray 2
   nodes`, every edge but the frontend's a net edge). Median request latency.

    python benchmarks/net_edge.py                # needs `pip install 'omniflow[ray]'`
    python benchmarks/net_edge.py --quick
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

from omniflow.compiler import compile_source
from omniflow.runtime.doorbells import ChunkMeta
from omniflow.runtime.engine import Engine
from omniflow.runtime.net_ring import NetConsumer, NetProducer
from omniflow.runtime.shm_ring import ShmConsumer, ShmProducer

KiB, MiB = 1 << 10, 1 << 20
SIZES = {4 * KiB: 5000, 64 * KiB: 2000, 1 * MiB: 300, 16 * MiB: 40, 64 * MiB: 12}
RINGS = {"net": (NetConsumer, NetProducer), "shm": (ShmConsumer, ShmProducer)}
SPAWN = mp.get_context("spawn")
STAGE = "python(fn=omniflow.runtime.builtin_stages.identity, max_batch=1)"
CHAIN = f"""pipeline chain {{
  stage a = {STAGE}
  stage b = {STAGE}
  input x: tokens -> a
  a.out -> b.in [stream, chunk=8]
  b.out -> output y [stream]
  SEPARATE
}}"""


def _produce(kind: str, name: str, size: int, count: int, go) -> None:
    producer = RINGS[kind][1].attach(name)
    payload = torch.randint(0, 255, (size,), dtype=torch.uint8)
    for i in range(count):
        if go is not None:
            go.recv()  # the consumer is idle again
        producer.put(payload, ChunkMeta("b", i, False, time.monotonic_ns()), timeout=60)
    producer.put((), ChunkMeta("b", count, True), timeout=60)
    time.sleep(0.5)  # zmq sends from its own thread
    producer.close()


def _ring_times(kind: str, slots: int, size: int, count: int, paced: bool) -> list[tuple[int, int]]:
    consumer = RINGS[kind][0].create(slots, size)
    ours, theirs = SPAWN.Pipe() if paced else (None, None)
    peer = SPAWN.Process(target=_produce, args=(kind, consumer.name, size, count, theirs))
    peer.start()
    times = []
    for _ in range(count):
        if ours is not None:
            ours.send(b"")
        got = consumer.get(timeout=120)
        times.append((got.meta.sent, time.monotonic_ns()))
        got.release()
    consumer.get(timeout=60).release()
    peer.join(60)
    consumer.close()
    return times


class _Sink:
    """A Ray actor that takes tensors (made remote in main, once Ray is imported)."""

    def take(self, tensor: torch.Tensor) -> int:
        return tensor.numel()


def _ray_call_rate(sink, size: int, count: int) -> float:
    import ray

    payload = torch.randint(0, 255, (size,), dtype=torch.uint8)
    ray.get(sink.take.remote(payload))
    start = time.perf_counter()
    ray.get([sink.take.remote(payload) for _ in range(count)])
    return size * count / (time.perf_counter() - start)


def _ray_call_latency_us(sink, count: int) -> float:
    import ray

    payload = torch.randint(0, 255, (4 * KiB,), dtype=torch.uint8)
    times = []
    for _ in range(count):
        start = time.perf_counter_ns()
        ray.get(sink.take.remote(payload))
        times.append((time.perf_counter_ns() - start) / 2e3)
    return statistics.median(times)


def _hop_latency_us(plan, mode: str, requests: int) -> float:
    with Engine(plan, mode) as engine:
        for _ in range(20):
            engine.generate({"x": [1]})
        times = []
        for _ in range(requests):
            start = time.perf_counter()
            engine.generate({"x": [1]})
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 4}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    ray.init(address=cluster.address, include_dashboard=False, logging_level="ERROR")
    sink = ray.remote(_Sink).remote()

    sizes = {s: max(n // 10, 3) for s, n in SIZES.items() if s <= MiB} if args.quick else SIZES
    print(
        f"{'payload':>9} {'net GB/s':>9} {'shm GB/s':>9} {'ray call':>9} {'net/shm':>8} {'net/ray':>8}"
    )
    for size, count in sizes.items():
        rates = {}
        for kind in RINGS:
            times = _ring_times(kind, 4, size, count, paced=False)
            rates[kind] = size * count / ((times[-1][1] - times[0][0]) / 1e9)
        rates["ray"] = _ray_call_rate(sink, size, count)
        label = f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"
        print(
            f"{label:>9} {rates['net'] / 1e9:9.2f} {rates['shm'] / 1e9:9.2f} "
            f"{rates['ray'] / 1e9:9.2f} {rates['net'] / rates['shm']:7.2f}x "
            f"{rates['net'] / rates['ray']:7.2f}x"
        )
    count = 300 if args.quick else 2000
    latency = {}
    for kind in RINGS:
        times = _ring_times(kind, 1, 4 * KiB, count, paced=True)
        latency[kind] = statistics.median((b - a) / 1e3 for a, b in times)
    latency["ray call"] = _ray_call_latency_us(sink, count)
    print("\n4 KiB one-way latency (us, median)")
    for name, value in latency.items():
        print(f"{name:>12} {value:9.1f} {value / latency['shm']:7.2f}x")

    requests = 50 if args.quick else args.requests
    plain = compile_source(CHAIN.replace("SEPARATE", ""), "c.omni")
    hop = {"process": _hop_latency_us(plain, "process", requests)}
    one_node = compile_source(CHAIN.replace("SEPARATE", ""), "c.omni", devices="ray:auto")
    hop["ray"] = _hop_latency_us(one_node, "ray", requests)
    cluster.add_node(**node)
    cluster.wait_for_nodes()
    spread = CHAIN.replace("SEPARATE", "separate a, b")
    hop["ray 2 nodes"] = _hop_latency_us(
        compile_source(spread, "c.omni", devices="ray:auto"), "ray", requests
    )
    ray.shutdown()
    cluster.shutdown()
    print(f"\none-token request through 2 executors, median of {requests} (us)")
    for name, value in hop.items():
        print(f"{name:>12} {value:9.0f} {value / hop['process']:7.2f}x")


if __name__ == "__main__":
    main()
