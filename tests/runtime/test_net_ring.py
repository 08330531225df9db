"""Net rings (the `net` edges between nodes) over TCP loopback with a real peer process:
every dtype and shape arrives intact as views of the consumer's pre-allocated slots, and the
credits hold a fast producer back without losing a chunk."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from omniflow.errors import PayloadTooLarge
from omniflow.runtime.doorbells import ChunkMeta
from omniflow.runtime.net_ring import NetConsumer, NetProducer
from tests.runtime.test_shm_ring import _same, _samples, _stream, drain_stream

SPAWN = mp.get_context("spawn")


def close_drained(producer: NetProducer) -> None:
    """Close once the consumer has taken everything: zmq sends from its own thread, and a
    close drops what it has not sent yet."""
    deadline = time.monotonic() + 60
    while not producer.drained() and time.monotonic() < deadline:
        time.sleep(0.01)
    producer.close()


def _send_samples(name: str) -> None:
    producer = NetProducer.attach(name)
    samples = _samples()
    chunks = [(t,) for t in samples] + [tuple(samples)]
    for i, chunk in enumerate(chunks):
        producer.put(chunk, ChunkMeta("req-1", i, end=i == len(chunks) - 1), timeout=30)
    close_drained(producer)


def _stream_to(name: str, n: int) -> None:
    producer = NetProducer.attach(name)
    _stream(producer, n)
    close_drained(producer)


@pytest.fixture
def peer():
    started = []

    def start(target, *args):
        process = SPAWN.Process(target=target, args=args)
        process.start()
        started.append(process)
        return process

    yield start
    for process in started:
        process.join(10)
        if process.is_alive():
            process.kill()


def test_round_trip_from_a_peer_into_the_slots(peer):
    consumer = NetConsumer.create(2, 4096)
    sender = peer(_send_samples, consumer.name)
    samples = _samples()
    chunks = [(t,) for t in samples] + [tuple(samples)]
    slots = consumer._memory
    for i, chunk in enumerate(chunks):
        with consumer.get(timeout=30) as item:
            assert item.meta.request_id == "req-1" and item.meta.chunk == i
            assert item.meta.end == (i == len(chunks) - 1)
            for sent, got in zip(chunk, item.tensors, strict=True):
                assert _same(sent, got), (sent, got)
                if got.numel():  # a view of the pre-allocated slots, not a fresh buffer
                    start = slots.data_ptr()
                    assert start <= got.data_ptr() < start + slots.numel()
    sender.join(30)  # it closes once every slot is back: the consumer stays open till then
    assert sender.exitcode == 0
    consumer.close()


def test_backpressure_holds_a_fast_producer_back_without_loss(peer):
    n = 500
    consumer = NetConsumer.create(4, 4096)
    sender = peer(_stream_to, consumer.name, n)
    waits = drain_stream(consumer, n, 0.0005)
    assert waits > n // 2, "the producer rarely waited for a credit"
    sender.join(30)
    assert sender.exitcode == 0
    consumer.close()


def test_a_payload_bigger_than_a_slot_names_the_sizes():
    consumer = NetConsumer.create(2, 64)
    producer = NetProducer.attach(consumer.name)
    with pytest.raises(PayloadTooLarge, match="payload of 400 bytes .* 64-byte slot"):
        producer.put(torch.zeros(100), ChunkMeta("r"))
    producer.put(torch.arange(4.0), ChunkMeta("r", 1))  # nothing of the refused one went out
    with consumer.get(timeout=10) as item:
        assert item.meta.chunk == 1 and torch.equal(item.tensors[0], torch.arange(4.0))
    producer.close()
    consumer.close()
