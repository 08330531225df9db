"""Device rings (cuda-ipc, p2p) between real processes on a real GPU: tensors arrive on the
GPU as views of the ring, credits bound what a producer may run ahead, and a process that
dies -- holding slots or not -- leaves no device memory and no segment behind."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from omniflow.errors import ChannelError
from omniflow.runtime.device_ring import DeviceConsumer, DeviceProducer
from omniflow.runtime.doorbells import ChunkMeta
from omniflow.runtime.shm_ring import SEGMENT_PREFIX, SHM_DIR, cleanup_stale_segments

pytestmark = pytest.mark.gpu
SPAWN = mp.get_context("spawn")
MiB = 1 << 20


def _chunk(i: int, device: str = "cuda:0") -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(1000 + i, 33, generator=g).to(torch.bfloat16).to(device)


def _produce(name: str, count: int, device: str, done, late: bool = False) -> None:
    """A producer process: attaches and puts `count` chunks made on `device`, then waits.
    `late`: each chunk is made after ~50 ms of GPU work, so its bytes land long after `put`
    returns on the host."""
    producer = DeviceProducer.attach(name)
    for i in range(count):
        if late:
            torch.cuda._sleep(100_000_000)
        producer.put([_chunk(i, device), torch.tensor([i])], ChunkMeta("r", i, i == count - 1))
    done.wait(60)
    producer.close()


def _consume(ring_bytes: int, names, hold: int, release) -> None:
    """A consumer process: creates a ring of two slots on cuda:0, takes and holds `hold`
    chunks, releases one when told, then holds the rest until it is killed or told again."""
    consumer = DeviceConsumer.create(2, ring_bytes // 2, "cuda:0")
    names.put(consumer.name)
    held = [consumer.get(timeout=60) for _ in range(hold)]
    release.wait(60)
    held.pop(0).release()
    time.sleep(60)  # holds the others: the test kills it here


def free_bytes(device: int = 0) -> int:
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]


def settled_free_bytes(expected: int, slack: int, device: int = 0) -> int:
    """Device-wide free memory once the driver has reclaimed a dead process's (it does so
    asynchronously): polls until at most `slack` below `expected`, up to 10 s. (More free
    than before is no leak: other processes' memory on the device may have gone meanwhile.)"""
    for _ in range(100):
        free = free_bytes(device)
        if free >= expected - slack:
            return free
        time.sleep(0.1)
    return free


def _our_segments() -> list[str]:
    return [p.name for p in SHM_DIR.glob(f"{SEGMENT_PREFIX}{os.getpid()}-*")]


@pytest.fixture
def processes():
    started = []
    yield started
    for p in started:
        if p.is_alive():
            p.kill()
        p.join(10)


def _start(processes: list, target, *args):
    p = SPAWN.Process(target=target, args=args)
    p.start()
    processes.append(p)
    return p


def test_gpu_tensors_cross_processes_as_views_of_the_ring(processes):
    consumer = DeviceConsumer.create(4, 256 * 1024, "cuda:0")
    done = SPAWN.Event()
    p = _start(processes, _produce, consumer.name, 6, "cuda:0", done)
    base = consumer._buffer.data_ptr()
    for i in range(6):
        with consumer.get(timeout=60) as got:
            data, index = got.tensors
            assert got.meta == ChunkMeta("r", i, i == 5, got.meta.sent)
            assert data.device == torch.device("cuda:0")  # never copied to host
            assert base <= data.data_ptr() < base + 4 * 256 * 1024
            assert torch.equal(data, _chunk(i))
            assert int(index) == i
    done.set()
    p.join(30)
    assert p.exitcode == 0
    consumer.close()


def test_hand_off_is_ordered_on_the_gpu_not_the_host(processes):
    """Neither end waits for the GPU: the consumer sees a chunk whose bytes were still being
    made when the producer rang, and a copy the consumer queued on a slot before releasing
    it still reads that chunk, though the producer fills the slot again right away."""
    consumer = DeviceConsumer.create(1, 256 * 1024, "cuda:0")
    done = SPAWN.Event()
    _start(processes, _produce, consumer.name, 4, "cuda:0", done, True)
    kept = []
    for _ in range(4):
        got = consumer.get(timeout=60)
        torch.cuda._sleep(100_000_000)  # the clone runs ~50 ms after release() returns
        kept.append(got.tensors[0].clone())
        got.release()
    for i, tensor in enumerate(kept):
        assert torch.equal(tensor, _chunk(i))
    done.set()
    consumer.close()


@pytest.mark.parametrize(
    ("source", "ring"),
    [("cpu", "cuda:0"), ("cuda:0", "cuda:1")],
    ids=["host-to-device", "p2p"],
)
def test_copies_from_elsewhere_land_in_the_consumers_ring(processes, source, ring):
    """A CPU tensor goes in by a host-to-device copy; a tensor on another GPU (p2p) by a peer
    copy into the consumer's GPU (written here, measured on two GPUs elsewhere)."""
    if torch.device(ring).index >= torch.cuda.device_count():
        pytest.skip(f"needs {ring}")
    consumer = DeviceConsumer.create(2, 128 * 1024, ring)
    done = SPAWN.Event()
    _start(processes, _produce, consumer.name, 3, source, done)
    for i in range(3):
        with consumer.get(timeout=60) as got:
            assert got.tensors[0].device == torch.device(ring)
            assert torch.equal(got.tensors[0], _chunk(i, ring))
    done.set()
    consumer.close()


def test_credits_bound_the_producer_and_a_killed_consumer_leaves_no_device_memory(processes):
    ring_bytes = 256 * MiB
    names, release = SPAWN.Queue(), SPAWN.Event()
    baseline = free_bytes()
    p = _start(processes, _consume, ring_bytes, names, 2, release)
    producer = DeviceProducer.attach(names.get(timeout=60))
    chunk = torch.ones(ring_bytes // 2 // 4, device="cuda:0")
    producer.put(chunk, ChunkMeta("r", 0), timeout=60)
    producer.put(chunk, ChunkMeta("r", 1), timeout=60)
    # both slots are held: backpressure
    assert not producer.try_put(chunk, ChunkMeta("r", 2))
    release.set()
    producer.put(chunk, ChunkMeta("r", 2), timeout=60)  # the credit came back
    assert not producer.try_put(chunk, ChunkMeta("r", 3))
    # killed while it holds every slot of the ring it allocated
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    with pytest.raises(ChannelError, match="peer closed the channel or exited"):
        producer.put(chunk, ChunkMeta("r", 3), timeout=10)
    producer.close()
    del chunk
    gc.collect()
    torch.cuda.empty_cache()
    # the dead consumer's ring and context are back with the device, our mapping closed
    assert settled_free_bytes(baseline, 64 * MiB) >= baseline - 64 * MiB
    cleanup_stale_segments()  # what the engine's restart does
    assert not list(SHM_DIR.glob(f"{SEGMENT_PREFIX}{p.pid}-*"))


def test_a_killed_producer_leaves_the_consumers_ring_and_closing_frees_it(processes):
    ring_bytes = 256 * MiB
    baseline = free_bytes()
    consumer = DeviceConsumer.create(2, ring_bytes // 2, "cuda:0")
    assert baseline - free_bytes() >= ring_bytes  # outside torch's cache: the device's own
    done = SPAWN.Event()
    p = _start(processes, _produce, consumer.name, 1, "cuda:0", done)
    got = consumer.get(timeout=60)
    assert torch.equal(got.tensors[0], _chunk(0))
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    with pytest.raises(ChannelError, match="peer closed the channel or exited"):
        consumer.get(timeout=10)
    got.release()
    consumer.close()
    assert not _our_segments()
    del got
    gc.collect()
    assert settled_free_bytes(baseline, 64 * MiB) >= baseline - 64 * MiB


def cuda_ipc_plan():
    """graphs/tts.omni on one H200 with its decoder isolated (`isolate=true`: a process of its
    own, where the stages of one GPU would otherwise share one): the codes reach the decoder
    through a cuda-ipc ring."""
    from pathlib import Path

    from omniflow.compiler import compile_source

    source = (Path(__file__).parents[2] / "graphs" / "tts.omni").read_text()
    stage = 'vocoder(component="code2wav", max_batch=32)'
    assert stage in source
    source = source.replace(stage, stage[:-1] + ", isolate=true)")
    plan = compile_source(source, devices="1xH200")
    edge = next(c for c in plan.channels if c.name == "codec_lm.codes->decoder.codes")
    assert (edge.kind, edge.device) == ("cuda-ipc", "cuda:0")
    return plan


def test_an_engine_runs_a_cuda_ipc_edge_and_matches_the_interpreter():
    from omniflow.runtime.engine import Engine
    from omniflow.runtime.interpreter import Interpreter

    plan = cuda_ipc_plan()
    reference = Interpreter(plan, "standin")
    with Engine(plan, "process", backends="standin") as engine:
        decoder = next(pid for name, pid in engine.executor_pids.items() if "decoder" in name)
        # the decoder's ring of codes is a device ring: its segment holds no slots
        magics = [p.read_bytes()[:8] for p in SHM_DIR.glob(f"{SEGMENT_PREFIX}{decoder}-*")]
        assert DeviceConsumer._magic in magics
        for text in ("good morning", "hi"):
            got = engine.generate({"text": text})
            assert torch.equal(got["audio"], reference.run({"text": text})["audio"])
