"""Net rings: the `net` channels between nodes, with the shm ring's protocol over TCP.

The consumer (which creates every ring, as in the link phase) pre-allocates `slots x
slot_bytes` of host memory and binds a zmq PAIR socket on its node's address; the ring's
name, which the link phase hands the producer, is `net:HOST:PORT:SLOTS:SLOT_BYTES`. A put
is one multipart message: the `Doorbell` (the same msgpack struct as the shm ring's: slot,
`ChunkMeta`, a `TensorHeader` per tensor) then one frame per tensor; the consumer receives
each tensor frame straight into its slot at the header's offset (`recv_into`, no
allocation per message) and hands out views of the slot. `Credit`s travel back on the same
socket; free slots are the producer's credits, as everywhere: with none left a put waits.

zmq rather than Ray's channels: the frames go straight between the two executors' sockets
into pre-allocated slots, with the same messages and credit accounting as the other rings,
and the executors need no Ray object store on the data path (which copies a message into
shared memory on both nodes). A peer's death is not seen by the socket (TCP may not say
for minutes when a node vanishes); the engine learns it from the transport and re-links.
"""

from __future__ import annotations

import math
import time
from collections import deque
from contextlib import suppress
from functools import partial

import msgspec
import torch
import zmq

from omniflow.dtypes import dtype_name, torch_dtype
from omniflow.errors import ChannelError
from omniflow.runtime.doorbells import ChunkMeta, Credit, Doorbell, TensorHeader
from omniflow.runtime.shm_ring import (
    MAX_SLOTS,
    Consumer,
    Producer,
    Received,
    _align,
    _Deadline,
    slot_layout,
)

PREFIX = "net:"
_ENCODER = msgspec.msgpack.Encoder()
_DOORBELL = msgspec.msgpack.Decoder(Doorbell)
_CREDIT = msgspec.msgpack.Decoder(Credit)
# How often a put with a time limit retries while the consumer is not connected.
_RETRY_S = 0.001


def _socket() -> zmq.Socket:
    socket = zmq.Context.instance().socket(zmq.PAIR)
    socket.setsockopt(zmq.LINGER, 0)
    # The credits bound what is in flight; zmq's own limits would only add a second bound.
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    return socket


class _NetEndpoint:
    """What both ends share: the socket, and waiting on it."""

    _socket: zmq.Socket

    def fileno(self) -> int:
        """zmq's notification fd (edge-triggered: every use drains what is waiting)."""
        return self._socket.getsockopt(zmq.FD)

    def _wait(self, deadline: _Deadline, waiting_for: str) -> None:
        remaining = deadline.remaining(self, waiting_for)
        self._socket.poll(None if remaining is None else max(1, int(remaining * 1000)))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._socket.close(linger=0)


class NetConsumer(_NetEndpoint, Consumer):
    """The receiving end: owns the slots and the listening socket (`create`)."""

    def __init__(self, slots: int, slot_bytes: int, host: str):
        if not 1 <= slots <= MAX_SLOTS or slot_bytes < 1:
            raise ChannelError(
                f"a ring needs 1..{MAX_SLOTS} slots of >= 1 byte, not {slots} x {slot_bytes}"
            )
        self.slots, self.slot_bytes = slots, _align(slot_bytes)
        self._memory = torch.empty(self.slots * self.slot_bytes, dtype=torch.uint8)
        self._socket = _socket()
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.name = f"{PREFIX}{host}:{port}:{self.slots}:{self.slot_bytes}"

    @classmethod
    def create(cls, slots: int, slot_bytes: int, host: str = "127.0.0.1") -> NetConsumer:
        """A new ring listening on `host` (an address of this node that its peers reach)."""
        return cls(slots, slot_bytes, host)

    def _get(self, deadline: _Deadline | None) -> Received | None:
        if self._closed:
            raise ChannelError(f"{self} is closed")
        while True:
            try:
                bell = _DOORBELL.decode(self._socket.recv(zmq.NOBLOCK))
                break
            except zmq.Again:
                if deadline is None:
                    return None
                self._wait(deadline, "data from the producer")
        base = bell.slot * self.slot_bytes
        tensors = []
        for header in bell.tensors:
            dtype = torch_dtype(header.dtype)
            count = math.prod(header.shape)
            start = base + header.offset
            view = self._memory[start : start + count * dtype.itemsize]
            # The frames of one message arrive together: these receives never wait.
            if count:
                self._socket.recv_into(view.numpy(), flags=zmq.NOBLOCK)
            else:
                self._socket.recv(zmq.NOBLOCK)
            tensors.append(view.view(dtype).view(header.shape))
        return Received(bell.meta, tuple(tensors), partial(self._release, bell.slot))

    def _release(self, slot: int) -> None:
        if self._closed:
            return
        with suppress(zmq.Again):  # the producer is gone: nobody needs the credit
            self._socket.send(_ENCODER.encode(Credit(slot)), flags=zmq.NOBLOCK)


class NetProducer(_NetEndpoint, Producer):
    """The sending end: connects to a consumer's ring by its name (`attach`)."""

    def __init__(self, name: str):
        try:
            host, port, slots, slot_bytes = name.removeprefix(PREFIX).rsplit(":", 3)
            self.slots, self.slot_bytes = int(slots), int(slot_bytes)
        except ValueError:
            raise ChannelError(f"'{name}' is not a net ring's name") from None
        self.name = name
        self._free = deque(range(self.slots))
        self._socket = _socket()
        # Queue nothing for a connection that is not up: a send then says so (zmq.Again).
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.connect(f"tcp://{host}:{port}")

    @classmethod
    def attach(cls, name: str) -> NetProducer:
        if not name.startswith(PREFIX):
            raise ChannelError(f"'{name}' is not a net ring's name")
        return cls(name)

    def drained(self) -> bool:
        """Whether the consumer has released every slot: all that was put has arrived and
        been taken (a producer about to close may wait for it; closing drops what zmq has not
        sent yet)."""
        self._take_credits()
        return len(self._free) == self.slots

    def _take_credits(self) -> None:
        # Everything waiting, not just one: zmq's fd only says when something new arrives.
        while True:
            try:
                self._free.append(_CREDIT.decode(self._socket.recv(zmq.NOBLOCK)).slot)
            except zmq.Again:
                return

    def _put(
        self, tensors: tuple[torch.Tensor, ...], meta: ChunkMeta, deadline: _Deadline | None
    ) -> bool:
        offsets = slot_layout(tensors, self.slot_bytes, self)
        if self._closed:
            raise ChannelError(f"{self} is closed")
        self._take_credits()
        while not self._free:
            if deadline is None:
                return False
            self._wait(deadline, "a free slot (the consumer holds them all)")
            self._take_credits()
        slot = self._free.popleft()
        headers = tuple(
            TensorHeader(dtype_name(t.dtype), tuple(t.shape), offset)
            for t, offset in zip(tensors, offsets, strict=True)
        )
        frames = [_ENCODER.encode(Doorbell(slot, meta, headers))]
        frames += [_host_bytes(t) for t in tensors]
        while True:
            try:
                # Copied into zmq's messages (the ring's one copy, as the shm ring's into its
                # slot): the caller may reuse its tensor as soon as put returns.
                self._socket.send_multipart(frames, flags=zmq.NOBLOCK)
                return True
            except zmq.Again:
                # No connection to the consumer (not yet, or it died and the engine is about
                # to re-link): a blocking send would hang the loop; not now.
                if deadline is None:
                    self._free.appendleft(slot)
                    return False
                deadline.remaining(self, "a connection to the consumer")
                time.sleep(_RETRY_S)


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes for a frame (a view when it is contiguous on the host)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())
