"""The link phase: a program's ends of the channels it shares with other programs, how they
are made, and how they are made again after a peer restarts.

A program creates the ring of every channel it reads from another program (`create_rings`:
it is their consumer, so it owns the segments, a device ring's GPU memory and a net ring's
slots and listening socket: it holds the views into them, and a producer that dies takes
nothing of them along; the plan's edge kind says which ring) and attaches to the rings of the channels
it writes (`attach_rings`), by the names their consumers announced. In one process the two
ends of a channel are made together instead (`link_in_process`). Executors and the frontend
link through these same functions, at start and after a restart (`relink`).

`Inbound` drains a consumer end without blocking and hands out (request, value, end,
release) tuples; `Outbound` queues chunks in an outbox and puts them as credits allow, so a
full ring delays only its own edge, never the loop (two loops blocked on each other's full
rings would deadlock). Both expose `fileno()` for the loop's poll: the ring's doorbell
socket, or for in-process channels None (the peer pokes the loop's `Waker` instead).
"""

from __future__ import annotations

import os
import select
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator

import torch

from omniflow.plan import ChannelPlan
from omniflow.runtime.device_ring import DeviceConsumer, DeviceProducer
from omniflow.runtime.doorbells import ChunkMeta, Ending
from omniflow.runtime.net_ring import NetConsumer, NetProducer
from omniflow.runtime.port_values import TEXT_TYPES, decode, encode
from omniflow.runtime.shm_ring import (
    Consumer,
    LocalConsumer,
    LocalProducer,
    Producer,
    ShmConsumer,
    ShmProducer,
    local_channel,
    slot_layout,
)
from omniflow.runtime.streams import cuda_here
from omniflow.runtime.wakeup import Waker


class Inbound:
    def __init__(self, channel: ChannelPlan, endpoint: Consumer, peer: Waker | None = None):
        self.channel = channel
        self.endpoint = endpoint
        self.peer = peer  # in-process: poked on release so the producer sees its credit

    def fileno(self) -> int | None:
        return None if isinstance(self.endpoint, LocalConsumer) else self.endpoint.fileno()

    def receive(self) -> Iterator[tuple[ChunkMeta, object, Callable[[], None]]]:
        """Every chunk waiting now: (its meta, value or None, release)."""
        while (got := self.endpoint.try_get()) is not None:
            meta = got.meta
            release = self._releaser(got)
            value = decode(self.channel.type, got.tensors[0]) if got.tensors else None
            if self.channel.type in TEXT_TYPES:
                release()  # decoding copied the bytes out
                release = _noop
            yield meta, value, release

    def _releaser(self, got) -> Callable[[], None]:
        if self.peer is None:
            return got.release

        def release() -> None:
            got.release()
            self.peer.poke()

        return release

    def close(self) -> None:
        self.endpoint.close()


class Outbound:
    def __init__(self, channel: ChannelPlan, endpoint: Producer, peer: Waker | None = None):
        self.channel = channel
        self.endpoint = endpoint
        self.peer = peer  # in-process: poked after a put so the consumer wakes
        self.outbox: deque[tuple[tuple[torch.Tensor, ...], ChunkMeta]] = deque()

    def fileno(self) -> int | None:
        return None if isinstance(self.endpoint, LocalProducer) else self.endpoint.fileno()

    def send(
        self, request_id: str, index: int, value, end: bool, ending: Ending | None = None
    ) -> None:
        """Queue chunk `index` (None: only the end, with the producer's `ending`) and put
        what credits allow. A chunk that cannot fit a slot raises PayloadTooLarge before
        anything of it is queued."""
        if value is None:
            pieces = [()]
        else:
            wire = _wire(encode(self.channel.type, value), self.endpoint.on_device)
            pieces = [(p,) for p in self._fit(wire)]
            for tensors in pieces:
                slot_layout(tensors, self.endpoint.slot_bytes, self.channel.name)
        sent = time.monotonic_ns()
        for i, tensors in enumerate(pieces):
            last = end and i == len(pieces) - 1
            meta = ChunkMeta(request_id, index, last, sent, ending if last else None)
            self.outbox.append((tensors, meta))
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


def _wire(tensor: torch.Tensor, on_device: bool) -> torch.Tensor:
    """What a ring can copy: a tensor without autograd history, for a host ring a contiguous
    CPU one (a GPU tensor is copied to host here; a device ring takes it where it is)."""
    if on_device:
        return tensor.detach()
    if tensor.is_cpu and tensor.is_contiguous() and not tensor.requires_grad:
        return tensor  # most chunks: three dispatcher calls saved
    return tensor.detach().to("cpu").contiguous()


def _on_device(channel: ChannelPlan) -> bool:
    """Whether the channel's ring goes in GPU memory: the plan says so (cuda-ipc, p2p) and this
    process sees that GPU. A plan compiled for GPUs that runs where they are not -- stand-in
    stages on a CPU machine, as the tests run the examples -- links host rings instead (real
    stages never get here: preflight refuses the plan); both ends of a ring run on one host,
    so they decide alike."""
    return bool(channel.device) and cuda_here(channel.device)


def node_address() -> str:
    """The address this node's peers reach it by, for the net rings it listens on: the
    `OMNIFLOW_NODE_ADDRESS` environment variable, else the node's address in the Ray cluster
    this process belongs to, else loopback (one host)."""
    if address := os.environ.get("OMNIFLOW_NODE_ADDRESS"):
        return address
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


def _noop() -> None:
    pass


class Links:
    """One program's channel ends, by channel name."""

    def __init__(self):
        self.inbound: dict[str, Inbound] = {}
        self.outbound: dict[str, Outbound] = {}

    def create_rings(self, channels: list[ChannelPlan]) -> dict[str, str]:
        """A new ring of its planned kind for each channel this program reads; their names,
        which the channels' producers attach to."""
        names = {}
        for channel in channels:
            if channel.kind == "net":
                ring = NetConsumer.create(channel.slots, channel.slot_bytes, node_address())
            elif _on_device(channel):
                ring = DeviceConsumer.create(channel.slots, channel.slot_bytes, channel.device)
            else:
                ring = ShmConsumer.create(channel.slots, channel.slot_bytes)
            self.set_inbound(Inbound(channel, ring))
            names[channel.name] = ring.name
        return names

    def attach_rings(self, channels: list[ChannelPlan], rings: dict[str, str]) -> None:
        """Attach to the rings named for the channels this program writes."""
        by_name = {c.name: c for c in channels}
        for channel_name, ring_name in rings.items():
            channel = by_name[channel_name]
            if channel.kind == "net":
                kind = NetProducer
            else:
                kind = DeviceProducer if _on_device(channel) else ShmProducer
            self.set_outbound(Outbound(channel, kind.attach(ring_name)))

    def relink(self, channels_in: list[ChannelPlan], peers: list[str]) -> dict[str, str]:
        """After `peers` died: drop the ends they held the other side of; new rings for what
        they wrote to this program (their replacements attach to them)."""
        for name in [n for n, o in self.outbound.items() if o.channel.dst_executor in peers]:
            self.outbound.pop(name).close()
        return self.create_rings([c for c in channels_in if c.src_executor in peers])

    def set_inbound(self, inbound: Inbound) -> None:
        old = self.inbound.pop(inbound.channel.name, None)
        if old is not None:
            old.close()
        self.inbound[inbound.channel.name] = inbound

    def set_outbound(self, outbound: Outbound) -> None:
        old = self.outbound.pop(outbound.channel.name, None)
        if old is not None:
            old.close()
        self.outbound[outbound.channel.name] = outbound

    def poll_fds(self) -> list[tuple[int, int]]:
        """What a loop polls for its links: every inbound ring, and the outbound rings that
        hold chunks waiting for credits."""
        fds = [(fd, select.POLLIN) for i in self.inbound.values() if (fd := i.fileno()) is not None]
        return fds + [
            (fd, select.POLLIN)
            for o in self.outbound.values()
            if o.outbox and (fd := o.fileno()) is not None
        ]

    def close(self) -> None:
        for end in [*self.inbound.values(), *self.outbound.values()]:
            end.close()
        self.inbound.clear()
        self.outbound.clear()


def link_in_process(channels: list[ChannelPlan], links: dict[str, Links], wakers: dict) -> None:
    """Both ends of every channel between two programs of one process, made together:
    references pass through them, and each end pokes the other program's waker."""
    for channel in channels:
        producer, consumer = local_channel(channel.slots, channel.slot_bytes, channel.name)
        links[channel.src_executor].set_outbound(
            Outbound(channel, producer, peer=wakers[channel.dst_executor])
        )
        links[channel.dst_executor].set_inbound(
            Inbound(channel, consumer, peer=wakers[channel.src_executor])
        )
