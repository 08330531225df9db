"""Benchmark: handing one tensor across a pipeline edge, side by side in one run.

Transports, for payloads of 4 KiB .. 256 MiB:
- omniflow shm ring: `ShmProducer` here -> `ShmConsumer` in a spawned process (zero copy out)
- omniflow local: the in-process channel, producer thread -> consumer thread, and both ends
  in one thread (what a fused executor running two stages in one loop pays)
- memcpy: one torch `copy_` into a preallocated tensor, the bandwidth limit of any one-copy path
- mp.Queue + pickle: the tensor's numpy array through a `multiprocessing.Queue`
- vllm-omni-style: a re-implementation of vllm-omni's SharedMemoryConnector data path —
  msgpack-style serialization (bytes copies as in OmniSerializer), a fresh named /dev/shm
  segment per message, a per-key lock file held with fcntl.flock(LOCK_EX) on both sides; the
  reader copies out, unlinks, deserializes and removes the lock file, and the {shm: {name,
  size}} metadata reaches it over a queue.

Latency is one way: the producer writes time.perf_counter_ns() (CLOCK_MONOTONIC, the same
clock in every process) into the payload's first 8 bytes, the consumer subtracts it from its
own reading on arrival, and acknowledges on a side pipe before the next send, so each
message meets an idle channel. Throughput streams messages back to back: bytes over the time
from the first send to the last arrival. Consumers only take delivery (no reading of the
payload) — a zero-copy view and a private copy are both ready to compute on.

    python benchmarks/transfer.py            # full run (about a minute on 2 cores)
    python benchmarks/transfer.py --quick    # up to 16 MiB, few iterations
"""

from __future__ import annotations

import argparse
import fcntl
import json
import multiprocessing as mp
import os
import queue
import struct
import threading
import time
import uuid
import warnings
from multiprocessing import shared_memory

import msgspec
import numpy as np
import torch

from omniflow.dtypes import dtype_name, torch_dtype
from omniflow.runtime.doorbells import ChunkMeta
from omniflow.runtime.shm_ring import ShmConsumer, ShmProducer, local_channel

KiB, MiB = 1 << 10, 1 << 20
# payload -> (latency messages, throughput messages) for the fast transports; the slow ones
# (queue, vllm-omni-style) get a quarter, at least 3. p99 of few samples is close to the max.
SIZES = {
    4 * KiB: (3000, 6000),
    64 * KiB: (2000, 3000),
    1 * MiB: (500, 800),
    16 * MiB: (60, 80),
    64 * MiB: (30, 40),
    256 * MiB: (10, 12),
}
QUICK_SIZES = {size: (lat // 5, thr // 5) for size, (lat, thr) in SIZES.items() if size <= 16 * MiB}
WARMUP = 2
META = ChunkMeta("bench")
SLOW = {"queue", "vllm"}


def _stamp_of(received) -> int:
    array = received.numpy() if isinstance(received, torch.Tensor) else received
    return int(array.view(np.uint8)[:8].view(np.int64)[0])


# --- the vllm-omni-style connector -----------------------------------------------------------

_MSGPACK = msgspec.msgpack.Encoder()


def _omni_serialize(tensor: torch.Tensor) -> bytes:
    # vLLM's MsgpackEncoder puts the tensor's bytes in an aux buffer next to (dtype, shape,
    # index); OmniSerializer copies each buffer to bytes and prefixes a length table.
    raw = tensor.flatten().contiguous().view(torch.uint8).numpy()
    main = _MSGPACK.encode((dtype_name(tensor.dtype), list(tensor.shape), 1))
    buffers = [main, bytes(memoryview(raw))]
    header = struct.pack("<BI", 1, len(buffers)) + b"".join(
        struct.pack("<I", len(b)) for b in buffers
    )
    return header + b"".join(buffers)


def _omni_deserialize(data: bytes) -> torch.Tensor:
    _, count = struct.unpack("<BI", data[:5])
    lengths = struct.unpack(f"<{count}I", data[5 : 5 + 4 * count])
    offset, buffers = 5 + 4 * count, []
    for length in lengths:
        buffers.append(data[offset : offset + length])
        offset += length
    dtype, shape, index = msgspec.msgpack.decode(buffers[0])
    return torch.frombuffer(buffers[index], dtype=torch.uint8).view(torch_dtype(dtype)).view(shape)


def _shm_write_bytes(payload: bytes, name: str) -> dict:
    shm = shared_memory.SharedMemory(create=True, size=len(payload), name=name)
    shm.buf[: len(payload)] = payload
    shm.close()
    return {"name": shm.name, "size": len(payload)}


def _shm_read_bytes(meta: dict) -> bytes:
    shm = shared_memory.SharedMemory(name=meta["name"])
    data = bytes(shm.buf[: meta["size"]])
    shm.close()
    shm.unlink()
    return data


def _lock_file(key: str) -> str:
    return f"/dev/shm/shm_{key}_lockfile.lock"


def vllm_put(key: str, tensor: torch.Tensor) -> dict:
    payload = _omni_serialize(tensor)
    with open(_lock_file(key), "wb+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        meta = _shm_write_bytes(payload, key)
        fcntl.flock(lock, fcntl.LOCK_UN)
    return {"shm": meta, "size": len(payload)}


def vllm_get(metadata: dict) -> torch.Tensor:
    with open(_lock_file(metadata["shm"]["name"]), "rb+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = _shm_read_bytes(metadata["shm"])
        fcntl.flock(lock, fcntl.LOCK_UN)
    tensor = _omni_deserialize(data)
    os.remove(_lock_file(metadata["shm"]["name"]))
    return tensor


# --- both ends of a measurement --------------------------------------------------------------


def consume(receive, ack, n_latency: int, n_throughput: int) -> tuple[list[int], int]:
    """Receive WARMUP + n_latency acknowledged messages, then n_throughput streamed ones.
    `receive()` returns (payload, release)."""
    latencies = []
    for _ in range(WARMUP + n_latency):
        payload, release = receive()
        arrived = time.perf_counter_ns()
        latencies.append(arrived - _stamp_of(payload))
        release()
        ack()
    for _ in range(n_throughput):
        _, release = receive()
        release()
    return latencies[WARMUP:], time.perf_counter_ns()


def produce(send, wait_ack, payload: torch.Tensor, n_latency: int, n_throughput: int) -> int:
    """The producer's half of `consume`; returns when the throughput stream started."""
    clock = payload.numpy()[:8].view(np.int64)
    for _ in range(WARMUP + n_latency):
        clock[0] = time.perf_counter_ns()
        send(payload)
        wait_ack()
    start = time.perf_counter_ns()
    for _ in range(n_throughput):
        send(payload)
    return start


def _nothing() -> None:
    pass


def _receiver(command: dict, data_queue, meta_queue):
    """(receive, close) for the consumer's side of `command`'s transport."""
    if command["transport"] == "ring":
        ring = ShmConsumer.attach(command["ring"])

        def receive():
            item = ring.get()
            return item.tensors[0], item.release

        return receive, ring.close
    if command["transport"] == "queue":
        return lambda: (data_queue.get(), _nothing), _nothing
    return lambda: (vllm_get(meta_queue.get()), _nothing), _nothing


def _setup() -> None:
    # One thread per process: on 2 cores, intra-op thread pools in the producer and the
    # consumer oversubscribe the CPUs and a copy stalls for whole scheduler slices (~8 ms).
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


def consumer_process(control, ack, data_queue, meta_queue) -> None:
    """The far side of every cross-process edge; one command per (transport, payload)."""
    _setup()
    while True:
        command = json.loads(control.recv_bytes())
        if command["transport"] == "quit":
            return
        receive, close = _receiver(command, data_queue, meta_queue)
        latencies, end = consume(
            receive, lambda: ack.send_bytes(b""), command["latency"], command["throughput"]
        )
        close()
        control.send_bytes(json.dumps({"latencies": latencies, "end": end}).encode())


class Bench:
    """This process produces; one spawned process consumes every cross-process transport."""

    def __init__(self):
        spawn = mp.get_context("spawn")
        self.control, far_control = spawn.Pipe()
        self.acks, far_acks = spawn.Pipe(duplex=False)
        self.data_queue, self.meta_queue = spawn.Queue(), spawn.Queue()
        self.consumer = spawn.Process(
            target=consumer_process, args=(far_control, far_acks, self.data_queue, self.meta_queue)
        )
        self.consumer.start()

    def close(self):
        self.control.send_bytes(json.dumps({"transport": "quit"}).encode())
        self.consumer.join()

    def _sender(self, command: dict, size: int):
        """(send, close) for the producer's side; adds what the consumer needs to `command`."""
        if command["transport"] == "ring":
            ring = ShmProducer.create(2, size)  # the buffer plan's default credits
            command["ring"] = ring.name
            return lambda payload: ring.put(payload, META), ring.close
        if command["transport"] == "queue":
            return lambda payload: self.data_queue.put(payload.numpy()), _nothing

        def send(payload):
            self.meta_queue.put(vllm_put(f"bench_{uuid.uuid4().hex}", payload))

        return send, _nothing

    def cross_process(self, transport: str, size: int, n_latency: int, n_throughput: int):
        command = {"transport": transport, "latency": n_latency, "throughput": n_throughput}
        send, close = self._sender(command, size)
        self.control.send_bytes(json.dumps(command).encode())
        payload = torch.zeros(size, dtype=torch.uint8)
        start = produce(send, self.acks.recv_bytes, payload, n_latency, n_throughput)
        result = json.loads(self.control.recv_bytes())
        close()
        return result["latencies"], n_throughput * size / (result["end"] - start)


def local_threads(size: int, n_latency: int, n_throughput: int):
    producer, consumer = local_channel(4, size)
    acks: queue.SimpleQueue = queue.SimpleQueue()
    result = []

    def receive():
        item = consumer.get()
        return item.tensors[0], item.release

    far = threading.Thread(
        target=lambda: result.append(
            consume(receive, lambda: acks.put(None), n_latency, n_throughput)
        )
    )
    far.start()
    payload = torch.zeros(size, dtype=torch.uint8)
    start = produce(lambda p: producer.put(p, META), acks.get, payload, n_latency, n_throughput)
    far.join()
    latencies, end = result[0]
    return latencies, n_throughput * size / (end - start)


def _timed(step, n: int) -> tuple[list[int], float]:
    """Per-call latencies of `step()` after WARMUP calls, and calls per nanosecond overall."""
    for _ in range(WARMUP):
        step()
    latencies = []
    for _ in range(n):
        begin = time.perf_counter_ns()
        step()
        latencies.append(time.perf_counter_ns() - begin)
    return latencies, n / sum(latencies)


def local_same_thread(size: int, n_latency: int, n_throughput: int):
    producer, consumer = local_channel(4, size)
    payload = torch.zeros(size, dtype=torch.uint8)

    def hand_off():
        producer.put(payload, META)
        consumer.get().release()

    latencies, rate = _timed(hand_off, n_latency + n_throughput)
    return latencies, rate * size


def memcpy(size: int, n_latency: int, n_throughput: int):
    source, target = torch.ones(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
    latencies, rate = _timed(lambda: target.copy_(source), n_latency + n_throughput)
    return latencies, rate * size


# --- report ----------------------------------------------------------------------------------

ROWS = [
    ("ring", "omniflow shm ring (x-process)"),
    ("threads", "omniflow local (thread->thread)"),
    ("same", "omniflow local (same thread)"),
    ("memcpy", "memcpy (torch copy_)"),
    ("queue", "mp.Queue + pickle (x-process)"),
    ("vllm", "vllm-omni-style shm connector"),
]
IN_PROCESS = {"threads": local_threads, "same": local_same_thread, "memcpy": memcpy}


def _p50(key: str):
    return lambda by_key: by_key[key][1]


def _speed_ratio(key: str, other: str):
    return lambda by_key: by_key[key][0] / by_key[other][0]


# (what, payload, measure, "<=" or ">=", bound): the targets the ring was built for.
TARGETS = [
    ("shm ring p50 µs", 4 * KiB, _p50("ring"), "<=", 50),
    ("local p50 µs, same thread", 4 * KiB, _p50("same"), "<=", 5),
    ("local p50 µs, thread->thread", 4 * KiB, _p50("threads"), "<=", 5),
    ("shm ring GiB/s / memcpy", 64 * MiB, _speed_ratio("ring", "memcpy"), ">=", 0.7),
    ("shm ring GiB/s / vllm-omni-style", 64 * MiB, _speed_ratio("ring", "vllm"), ">=", 50),
]


def _size_name(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


def run(sizes: dict[int, tuple[int, int]]) -> dict[int, dict[str, tuple[float, float, float]]]:
    """payload -> transport -> (GiB/s, p50 µs, p99 µs)."""
    bench = Bench()
    results = {}
    try:
        for size, (n_latency, n_throughput) in sizes.items():
            results[size] = {}
            for key, _ in ROWS:
                counts = (n_latency, n_throughput)
                if key in SLOW:
                    counts = (max(3, n_latency // 4), max(3, n_throughput // 4))
                if key in IN_PROCESS:
                    latencies, bytes_per_ns = IN_PROCESS[key](size, *counts)
                else:
                    latencies, bytes_per_ns = bench.cross_process(key, size, *counts)
                p50, p99 = np.percentile(latencies, [50, 99]) / 1e3
                results[size][key] = (bytes_per_ns * 1e9 / (1 << 30), p50, p99)
            print(f"  measured {_size_name(size)}", flush=True)
    finally:
        bench.close()
    return results


def report(results) -> None:
    print(f"\n{'payload':>8}  {'transport':<34}{'GiB/s':>10}{'p50 µs':>12}{'p99 µs':>12}")
    for size, by_key in results.items():
        for i, (key, label) in enumerate(ROWS):
            gibs, p50, p99 = by_key[key]
            name = _size_name(size) if i == 0 else ""
            print(f"{name:>8}  {label:<34}{gibs:>10.2f}{p50:>12.1f}{p99:>12.1f}")

    print("\nshm ring vs the others: GiB/s ratio (ring / other), p50 speed-up (other / ring)")
    print(
        f"{'payload':>8}{'/memcpy':>10}{'/queue':>10}{'/vllm-style':>13}{'queue p50':>12}{'vllm p50':>11}"
    )
    for size, by_key in results.items():
        gibs = {key: by_key[key][0] for key in ("ring", "memcpy", "queue", "vllm")}
        p50 = {key: by_key[key][1] for key in ("ring", "queue", "vllm")}
        print(
            f"{_size_name(size):>8}{gibs['ring'] / gibs['memcpy']:>10.2f}"
            f"{gibs['ring'] / gibs['queue']:>10.1f}{gibs['ring'] / gibs['vllm']:>13.1f}"
            f"{p50['queue'] / p50['ring']:>12.1f}{p50['vllm'] / p50['ring']:>11.1f}"
        )

    print("\ntargets")
    for what, size, measure, op, bound in TARGETS:
        if size in results:
            got = measure(results[size])
            met = got <= bound if op == "<=" else got >= bound
            print(
                f"  {'met ' if met else 'MISS'}  {_size_name(size):>6} {what:<34} {got:8.2f}  ({op} {bound})"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="stop at 16 MiB, few iterations")
    args = parser.parse_args()
    _setup()
    sizes = QUICK_SIZES if args.quick else SIZES
    print(f"transfer benchmark: {os.cpu_count()} CPUs, torch {torch.__version__}", flush=True)
    began = time.monotonic()
    results = run(sizes)
    report(results)
    print(f"\n({time.monotonic() - began:.0f} s)")


if __name__ == "__main__":
    main()
