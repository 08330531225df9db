"""An executor's ends of its cross-executor channels, as its event loop drives them.

`Inbound` drains a consumer end without blocking and hands out (request, chunk, value,
release) tuples; `Outbound` queues chunks in an outbox and puts them as credits allow, so
a full ring delays only its own edge, never the loop (two nodes blocked on each other's
full rings would deadlock). Both expose `fileno()` for the loop's poll: the ring's doorbell
socket, or for in-process channels the owning node's `Waker`, which the peer pokes.
"""

from __future__ import annotations

import contextlib
import os
import select
from collections import deque
from collections.abc import Callable, Iterator

import torch

from omniflow.plan import ChannelPlan
from omniflow.runtime.messages import ChunkMeta
from omniflow.runtime.shm_ring import Consumer, LocalConsumer, LocalProducer, Producer
from omniflow.runtime.values import TEXT_TYPES, decode, encode


class Waker:
    """An eventfd a node's loop polls; anything that has work for the node pokes it."""

    def __init__(self):
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def poke(self) -> None:
        os.eventfd_write(self.fd, 1)

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.fd)

    def close(self) -> None:
        os.close(self.fd)


def wait(fds: list[tuple[int, int]], timeout_s: float) -> set[int]:
    """Block until one of (fd, events) is ready, or `timeout_s` passes; the fds that are ready."""
    poller = select.poll()
    for fd, events in fds:
        poller.register(fd, events)
    return {fd for fd, _events in poller.poll(max(0, int(timeout_s * 1000)))}


def link_fds(inbound, outbound) -> list[tuple[int, int]]:
    """What a node's loop polls for its links: every inbound ring, and the outbound rings
    that hold chunks waiting for credits."""
    fds = [(fd, select.POLLIN) for i in inbound if (fd := i.fileno()) is not None]
    return fds + [
        (fd, select.POLLIN) for o in outbound if o.outbox and (fd := o.fileno()) is not None
    ]


class Inbound:
    def __init__(self, channel: ChannelPlan, endpoint: Consumer, peer: Waker | None = None):
        self.channel = channel
        self.endpoint = endpoint
        self.peer = peer  # in-process: poked on release so the producer sees its credit

    def fileno(self) -> int | None:
        return None if isinstance(self.endpoint, LocalConsumer) else self.endpoint.fileno()

    def receive(self) -> Iterator[tuple[str, int, object, bool, Callable[[], None]]]:
        """Every chunk waiting now: (request_id, index, value or None, end, release)."""
        while (got := self.endpoint.try_get()) is not None:
            meta = got.meta
            release = self._releaser(got)
            value = decode(self.channel.type, got.tensors[0]) if got.tensors else None
            if self.channel.type in TEXT_TYPES:
                release()  # decoding copied the bytes out
                release = _noop
            yield meta.request_id, meta.chunk, value, meta.eos, release

    def _releaser(self, got) -> Callable[[], None]:
        if self.peer is None:
            return got.release

        def release() -> None:
            got.release()
            self.peer.poke()

        return release

    def close(self) -> None:
        self.endpoint.close()


def _noop() -> None:
    pass


class Outbound:
    def __init__(self, channel: ChannelPlan, endpoint: Producer, peer: Waker | None = None):
        self.channel = channel
        self.endpoint = endpoint
        self.peer = peer  # in-process: poked after a put so the consumer wakes
        self.outbox: deque[tuple[tuple[torch.Tensor, ...], ChunkMeta]] = deque()

    def fileno(self) -> int | None:
        return None if isinstance(self.endpoint, LocalProducer) else self.endpoint.fileno()

    def send(self, request_id: str, index: int, value, end: bool) -> None:
        pieces = (
            [()]
            if value is None
            else [(p,) for p in self._fit(_wire(encode(self.channel.type, value)))]
        )
        for i, tensors in enumerate(pieces):
            self.outbox.append(
                (tensors, ChunkMeta(request_id, index, end and i == len(pieces) - 1))
            )
        self.flush()

    def _fit(self, wire: torch.Tensor) -> list[torch.Tensor]:
        """Text longer than a slot travels as several messages, cut between characters (text
        concatenates, so nothing changes for the reader); anything else must fit its slot."""
        limit = self.endpoint.slot_bytes
        if self.channel.type != "text" or wire.numel() <= limit:
            return [wire]
        pieces, start = [], 0
        while start < len(wire):
            end = min(start + limit, len(wire))
            while end < len(wire) and (int(wire[end]) & 0xC0) == 0x80:  # a UTF-8 continuation byte
                end -= 1
            pieces.append(wire[start:end])
            start = end
        return pieces

    def flush(self) -> bool:
        """Put what credits allow; True when the outbox is empty."""
        while self.outbox:
            tensors, meta = self.outbox[0]
            if not self.endpoint.try_put(tensors, meta):
                return False
            self.outbox.popleft()
            if self.peer is not None:
                self.peer.poke()
        return True

    def drop(self, request_ids: set[str] | None = None) -> None:
        """Forget queued chunks of these requests (all, if None)."""
        self.outbox = deque(
            c for c in self.outbox if request_ids is not None and c[1].request_id not in request_ids
        )

    def close(self) -> None:
        self.endpoint.close()


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """What a ring can copy: a contiguous CPU tensor without autograd history (a GPU tensor is
    copied to host here)."""
    if tensor.is_cpu and tensor.is_contiguous() and not tensor.requires_grad:
        return tensor  # most chunks: three dispatcher calls saved
    return tensor.detach().to("cpu").contiguous()
