"""Tensor channels: the shared-memory ring across real processes and /dev/shm, and the
in-process channel held to the same semantics."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch

from omniflow.errors import ChannelError
from omniflow.runtime.doorbells import ChunkMeta
from omniflow.runtime.shm_ring import (
    SEGMENT_PREFIX,
    SHM_DIR,
    ShmConsumer,
    ShmProducer,
    cleanup_stale_segments,
    local_channel,
    segment_creator,
)

SPAWN = mp.get_context("spawn")
KINDS = ["shm", "local"]
_spawned: set[int] = set()


def _creator_pid(name: str) -> int:
    pid = name[len(SEGMENT_PREFIX) :].split("-")[0]
    return int(pid) if pid.isdigit() else -1


def _our_segments() -> dict[str, int]:
    """Segments made by this test process or the peers it spawned (other users of the machine
    may have their own): name -> size in bytes."""
    pids = {os.getpid(), *_spawned}
    names = [p.name for p in SHM_DIR.glob(SEGMENT_PREFIX + "*") if _creator_pid(p.name) in pids]
    return {name: (SHM_DIR / name).stat().st_size for name in names}


def _mapping(name: str) -> tuple[int, int] | None:
    """The address range of this process's mapping of segment `name`, if any."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if f"/dev/shm/{name}" in line:
                start, end = line.split()[0].split("-")
                return int(start, 16), int(end, 16)
    return None


@pytest.fixture(autouse=True)
def no_leftover_segments():
    assert not _our_segments()
    yield
    assert not _our_segments(), "a test left omniflow segments in /dev/shm"


def _run_and_close(target, endpoints, args):
    try:
        target(*endpoints, *args)
    finally:
        for endpoint in endpoints:
            endpoint.close()


def _attach_and_run(target, handles, args):
    roles = {"producer": ShmProducer, "consumer": ShmConsumer}
    _run_and_close(target, [roles[role].attach(name) for role, name in handles], args)


class Peers:
    """Starts the other end of a channel: a spawned process for shm, a thread for local."""

    def __init__(self):
        self.processes: list[mp.process.BaseProcess] = []
        self.closers = []

    def channel(self, kind: str, mine: str, slots: int, slot_bytes: int):
        """My end (role `mine`) of a new channel, and the handle a peer opens the other end by."""
        if kind == "local":
            producer, consumer = local_channel(slots, slot_bytes)
            ends = (producer, consumer) if mine == "producer" else (consumer, producer)
        else:
            cls, theirs = (
                (ShmProducer, "consumer") if mine == "producer" else (ShmConsumer, "producer")
            )
            end = cls.create(slots, slot_bytes)
            ends = (end, (theirs, end.name))
        self.closers.append(ends[0].close)
        return ends

    def start(self, kind: str, target, handles, *args):
        if kind == "local":
            thread = threading.Thread(
                target=_run_and_close, args=(target, handles, args), daemon=True
            )
            thread.start()
            return thread
        process = SPAWN.Process(target=_attach_and_run, args=(target, handles, args))
        process.start()
        _spawned.add(process.pid)
        self.processes.append(process)
        return process

    def teardown(self):
        for close in self.closers:  # a peer waiting on us sees the end and exits
            close()
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()


@pytest.fixture
def peers():
    p = Peers()
    yield p
    p.teardown()


@pytest.fixture
def pair():
    """Both ends of a channel in this process (the shm ring works within one process too)."""
    opened = []

    def make(kind: str, slots: int, slot_bytes: int):
        if kind == "local":
            ends = local_channel(slots, slot_bytes)
        else:
            producer = ShmProducer.create(slots, slot_bytes)
            ends = (producer, ShmConsumer.attach(producer.name))
        opened.extend(ends)
        return ends

    yield make
    for end in opened:
        end.close()


# --- peers (module level, so a spawned process can import them) -----------------------------


def _echo(consumer, producer):
    """Send back every chunk until the producer closes."""
    while True:
        try:
            item = consumer.get(timeout=30)
        except ChannelError:
            return
        with item:
            producer.put(item.tensors, item.meta)


def _stream(producer, n: int):
    """Put chunks 0..n-1 as fast as possible; each carries its index and how often the
    producer found no free slot so far."""
    blocked = 0
    for i in range(n):
        chunk = (torch.full((256,), i, dtype=torch.int32), torch.tensor([i, blocked]))
        meta = ChunkMeta("stream", i, end=i == n - 1)
        if not producer.try_put(chunk, meta):
            blocked += 1
            producer.put(chunk, meta)


def drain_stream(consumer, n: int, pause: float, every_100=lambda: None) -> int:
    """Take what `_stream` puts, slowly (`pause` s per chunk), checking every chunk; how
    often the producer found no free slot."""
    for i in range(n):
        with consumer.get(timeout=30) as item:
            values, (index, blocked) = item.tensors
            assert item.meta == ChunkMeta("stream", i, end=i == n - 1)
            assert index == i and bool((values == i).all())
            waits = int(blocked)
        if i % 100 == 0:
            every_100()
        time.sleep(pause)  # the slow consumer
    return waits


def _hoard(consumer):
    """Take chunks and never release them."""
    held = []
    while True:
        held.append(consumer.get(timeout=None))


def _create_and_wait(conn):
    ring = ShmProducer.create(2, 1 << 16)
    conn.send(ring.name)
    time.sleep(60)


# --- tests --------------------------------------------------------------------------------


def _samples() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 5, generator=g),
        torch.randn(4, 7, generator=g).to(torch.bfloat16),
        torch.arange(-6, 6, dtype=torch.int64).view(3, 4),
        torch.tensor(-7, dtype=torch.int16),
        torch.randint(0, 256, (2, 3, 4), generator=g, dtype=torch.uint8),
        torch.tensor([True, False, True]),
        torch.empty(0, 3),
        torch.randn(8, 6, generator=g)[:, ::2],  # not contiguous
    ]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_through_a_peer(kind, peers):
    out, out_handle = peers.channel(kind, "producer", 2, 4096)
    back, back_handle = peers.channel(kind, "consumer", 2, 4096)
    peers.start(kind, _echo, (out_handle, back_handle))
    samples = _samples()
    chunks = [(t,) for t in samples] + [tuple(samples)]
    for i, chunk in enumerate(chunks):
        out.put(chunk, ChunkMeta("req-1", i, end=i == len(chunks) - 1))
        with back.get(timeout=30) as item:
            assert item.meta == ChunkMeta("req-1", i, end=i == len(chunks) - 1)
            assert len(item.tensors) == len(chunk)
            for sent, got in zip(chunk, item.tensors, strict=True):
                assert _same(sent, got), (sent, got)


@pytest.mark.parametrize("kind", KINDS)
def test_consumer_tensors_are_not_copies(kind, peers):
    out, out_handle = peers.channel(kind, "producer", 2, 1 << 16)
    back, back_handle = peers.channel(kind, "consumer", 2, 1 << 16)
    peers.start(kind, _echo, (out_handle, back_handle))
    sent = torch.arange(4096, dtype=torch.float32)
    out.put(sent, ChunkMeta("r"))
    with back.get(timeout=30) as item:
        got = item.tensors[0]
        assert torch.equal(got, sent)
        if kind == "local":
            assert got is sent
        else:
            start, end = _mapping(back.name)
            assert start <= got.data_ptr() and got.data_ptr() + got.nbytes <= end


@pytest.mark.parametrize("kind", KINDS)
def test_backpressure_blocks_a_fast_producer_without_loss(kind, peers):
    n, slots = 2000, 4
    consumer, handle = peers.channel(kind, "consumer", slots, 4096)
    peers.start(kind, _stream, (handle,), n)
    expected_shm = {consumer.name: consumer.size} if kind == "shm" else {}

    def nothing_grew():
        assert _our_segments() == expected_shm
        if kind == "shm":
            assert (SHM_DIR / consumer.name).stat().st_blocks * 512 >= consumer.size

    waits = drain_stream(consumer, n, 0.0002, every_100=nothing_grew)
    assert waits > n // 2, "the producer rarely waited for a credit"
    with pytest.raises(ChannelError, match="peer closed"):
        consumer.get(timeout=30)


@pytest.mark.parametrize("kind", KINDS)
def test_slots_can_be_released_out_of_order(kind, pair):
    producer, consumer = pair(kind, 4, 64)
    for i in range(4):
        producer.put(torch.full((4,), i), ChunkMeta("r", i))
    items = [consumer.get(timeout=5) for _ in range(4)]
    assert not producer.try_put(torch.zeros(4), ChunkMeta("r", 4))
    items[3].release()
    items[1].release()
    items[1].release()  # idempotent
    for i in (4, 5):
        producer.put(torch.full((4,), i), ChunkMeta("r", i), timeout=5)
    assert not producer.try_put(torch.zeros(4), ChunkMeta("r", 6))
    for held, i in ((items[0], 0), (items[2], 2)):  # untouched by the reuse of slots 1 and 3
        assert bool((held.tensors[0] == i).all())
    for i in (4, 5):
        with consumer.get(timeout=5) as item:
            assert item.meta.chunk == i and bool((item.tensors[0] == i).all())
    items[0].release()
    items[2].release()


@pytest.mark.parametrize("kind", KINDS)
def test_oversized_payload_names_the_sizes(kind, pair):
    producer, _ = pair(kind, 2, 256)
    with pytest.raises(ChannelError, match=r"payload of 400 bytes .* 256-byte slot"):
        producer.put(torch.zeros(100), ChunkMeta("r"))
    with pytest.raises(ChannelError, match=r"payload of 336 bytes \(2 tensor"):
        # 200 bytes padded to 256, then 80
        producer.put((torch.zeros(50), torch.zeros(20)), ChunkMeta("r"))


@pytest.mark.parametrize("kind", KINDS)
def test_get_and_put_time_out(kind, pair):
    producer, consumer = pair(kind, 2, 64)
    assert consumer.try_get() is None
    start = time.monotonic()
    with pytest.raises(ChannelError, match="timed out after 0.2 s waiting for data"):
        consumer.get(timeout=0.2)
    assert 0.2 <= time.monotonic() - start < 2
    producer.put(torch.zeros(2), ChunkMeta("r", 0))
    assert producer.try_put(torch.zeros(2), ChunkMeta("r", 1))
    assert not producer.try_put(torch.zeros(2), ChunkMeta("r", 2))
    start = time.monotonic()
    with pytest.raises(ChannelError, match="timed out after 0.2 s waiting for a free slot"):
        producer.put(torch.zeros(2), ChunkMeta("r", 2), timeout=0.2)
    assert 0.2 <= time.monotonic() - start < 2
    with consumer.get(timeout=0) as item:
        assert item.meta.chunk == 0


def _blocked_call_ends(call, close) -> float:
    """Runs `call` in a thread, calls `close`, and returns how long `call` took to fail after."""
    failed = []

    def run():
        with pytest.raises(ChannelError):
            call()
        failed.append(time.monotonic())

    waiter = threading.Thread(target=run)
    waiter.start()
    time.sleep(0.2)
    closed_at = time.monotonic()
    close()
    waiter.join(timeout=10)
    assert failed, "the blocked call did not end with ChannelError"
    return failed[0] - closed_at


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("closer", ["peer", "self"])
def test_close_wakes_a_blocked_get(kind, closer, pair):
    producer, consumer = pair(kind, 2, 64)
    close = producer.close if closer == "peer" else consumer.close
    assert _blocked_call_ends(lambda: consumer.get(timeout=30), close) < 2


@pytest.mark.parametrize("kind", KINDS)
def test_close_wakes_a_producer_blocked_on_credits(kind, pair):
    producer, consumer = pair(kind, 1, 64)
    producer.put(torch.zeros(2), ChunkMeta("r"))
    put = lambda: producer.put(torch.zeros(2), ChunkMeta("r"), timeout=30)  # noqa: E731
    assert _blocked_call_ends(put, consumer.close) < 2


@pytest.mark.parametrize("kind", KINDS)
def test_consumer_drains_what_was_put_before_the_producer_closed(kind, pair):
    producer, consumer = pair(kind, 4, 64)
    for i in range(3):
        producer.put(torch.full((2,), i), ChunkMeta("r", i, end=i == 2))
    with consumer.get(timeout=5):
        pass  # a credit the producer never reads before closing
    producer.close()
    for i in (1, 2):
        with consumer.get(timeout=5) as item:
            assert item.meta.chunk == i
    with pytest.raises(ChannelError, match="peer closed"):
        consumer.get(timeout=5)
    with pytest.raises(ChannelError, match="is closed"):
        producer.put(torch.zeros(2), ChunkMeta("r"))


@pytest.mark.parametrize("kind", KINDS)
def test_every_slot_can_hold_a_credit_in_flight(kind, pair):
    producer, consumer = pair(kind, 300, 64)
    for _ in range(2):
        for i in range(300):
            producer.put(torch.tensor([i]), ChunkMeta("r", i), timeout=5)
        items = [consumer.get(timeout=5) for _ in range(300)]
        assert [int(item.tensors[0]) for item in items] == list(range(300))
        for item in items:
            item.release()


def test_producer_killed_mid_stream_fails_the_consumer_quickly(peers):
    consumer, handle = peers.channel("shm", "consumer", 4, 4096)
    producer = peers.start("shm", _stream, (handle,), 10**9)
    for _ in range(50):
        consumer.get(timeout=30).release()
    os.kill(producer.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(ChannelError, match="peer closed"):
        while True:  # what was in flight is still delivered, then the end
            consumer.get(timeout=30).release()
    assert time.monotonic() - killed_at < 2


def test_consumer_killed_fails_a_blocked_producer_quickly(peers):
    producer, handle = peers.channel("shm", "producer", 2, 64)
    consumer = peers.start("shm", _hoard, (handle,))
    for i in range(2):
        producer.put(torch.zeros(2), ChunkMeta("r", i), timeout=30)
    threading.Timer(0.5, os.kill, (consumer.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(ChannelError, match="peer closed"):
        producer.put(torch.zeros(2), ChunkMeta("r", 2), timeout=30)
    assert 0.5 <= time.monotonic() - start < 2.5


def test_views_outlive_close_and_unmap_with_the_last_one(pair):
    producer, consumer = pair("shm", 2, 64)
    producer.put(torch.arange(8), ChunkMeta("r"))
    item = consumer.get(timeout=5)
    view = item.tensors[0]
    item.release()
    del item
    consumer.close()
    producer.close()
    assert not (SHM_DIR / consumer.name).exists()
    assert _mapping(consumer.name) is not None
    assert torch.equal(view, torch.arange(8))  # no segfault: the mapping lives on
    del view
    assert _mapping(consumer.name) is None
    producer.close()  # idempotent
    consumer.close()


def test_cleanup_removes_the_segments_of_a_killed_creator():
    receive, send = SPAWN.Pipe(duplex=False)
    creator = SPAWN.Process(target=_create_and_wait, args=(send,))
    creator.start()
    _spawned.add(creator.pid)
    name = receive.recv()
    os.kill(creator.pid, signal.SIGKILL)
    creator.join()
    assert (SHM_DIR / name).exists()
    with ShmProducer.create(2, 64) as alive:
        removed = cleanup_stale_segments()
        assert name in removed and alive.name not in removed
        assert not (SHM_DIR / name).exists() and (SHM_DIR / alive.name).exists()


def test_a_file_of_the_prefix_that_is_not_a_segment_is_nobodys(tmp_path):
    """Other files under the segments' prefix (a build's folder, a cache) name no creator:
    cleanup leaves them, and the tests' leak checks skip them."""
    assert segment_creator(f"{SEGMENT_PREFIX}{os.getpid()}-0a1b") == os.getpid()
    for other in (
        f"{SEGMENT_PREFIX}cache",
        f"{SEGMENT_PREFIX}Qwen--Qwen3-Omni-1",
        "omniflow_scaled",
    ):
        assert segment_creator(other) is None
    folder = SHM_DIR / f"{SEGMENT_PREFIX}cache-{tmp_path.name}"
    folder.mkdir()
    try:
        assert folder.name not in cleanup_stale_segments() and folder.is_dir()
    finally:
        folder.rmdir()


def test_attach_names_what_is_wrong():
    with pytest.raises(ChannelError, match="no ring segment"):
        ShmConsumer.attach(f"{SEGMENT_PREFIX}{os.getpid()}-missing")
    with ShmProducer.create(1, 64) as producer:
        name = producer.name
    with pytest.raises(ChannelError, match="no ring segment"):
        ShmConsumer.attach(name)
    with pytest.raises(ChannelError, match="1..512 slots"):
        ShmProducer.create(0, 64)
    bogus = SHM_DIR / f"{SEGMENT_PREFIX}{os.getpid()}-bogus"
    bogus.write_bytes(bytes(8192))
    try:
        with pytest.raises(ChannelError, match="not an omniflow ring"):
            ShmConsumer.attach(bogus.name)
    finally:
        bogus.unlink()
