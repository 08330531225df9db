"""Tensor channels for pipeline edges: the pre-allocated shared-memory ring that carries
tensors between executor processes, and its in-process twin with the same interface.

A channel has `slots` slots of `slot_bytes`. A producer `put`s one chunk (tensors plus a
`ChunkMeta`) into a free slot; the consumer `get`s a `Received` whose tensors stay valid
until it calls `release()`, which frees the slot. Free slots are the producer's credits:
with none left, `put` blocks (up to its timeout) — that is the backpressure. Slots may be
released in any order. A payload bigger than a slot raises ChannelError: the compiler's
buffer plan sized the slots, so exceeding them is a bug upstream.

Shared-memory ring (`ShmProducer` / `ShmConsumer`; either role may create, the other attaches
by name):
- Memory: one segment `/dev/shm/omniflow-<creator pid>-<hex>`, allocated and committed once —
  a control header (geometry, creator pid) then the slots. `put` copies the tensors' bytes
  into the slot, the only copy (a small contiguous CPU tensor with one `memmove`, anything
  else with torch's `copy_`); the consumer's tensors are views of its mapping.
- Doorbell: a connected AF_UNIX SOCK_SEQPACKET socket in the abstract namespace, named like
  the segment (it leaves nothing on disk). The producer sends a `Doorbell`, the consumer
  returns a `Credit`; both are msgspec structs of a few dozen bytes. A waiter polls for
  `SPIN_S`, yielding the CPU between polls, then blocks in the kernel. A peer that closes
  its end — or dies, since the kernel closes its sockets — ends the other side's wait at
  once with ChannelError. (Both ends must share a network namespace, which owns abstract
  socket names.)
- Lifetimes: the creator owns the name and unlinks it on `close()`, when garbage collected,
  or at interpreter exit; `cleanup_stale_segments()` removes segments whose creator was
  killed. The mapping is never unmapped explicitly: torch views hold a reference to it, so it
  goes away when the endpoint and the last tensor view are gone. `close()` therefore never
  invalidates a live view (unmapping under one would segfault on its next touch).

In-process channel (`local_channel`): the same interface and credit semantics over two C
queues; tensors pass by reference, nothing is copied.

An endpoint is driven by one thread at a time; `Received.release()` and `close()` may be
called from any thread, and `close()` wakes a waiter blocked on the same endpoint.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import queue
import secrets
import select
import socket
import struct
import time
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import suppress
from functools import partial
from pathlib import Path

import msgspec
import torch

from omniflow.dtypes import dtype_name, torch_dtype
from omniflow.errors import ChannelError, PayloadTooLarge
from omniflow.runtime.doorbells import ChunkMeta, Credit, Doorbell, TensorHeader

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "omniflow-"
DEFAULT_TIMEOUT = 30.0
# A tiny credit costs ~770 bytes of socket buffer (skb truesize); every slot's credit must
# fit at once or a consumer's release() could block behind an idle producer. A default
# kernel's send buffer limit (2 × net.core.wmem_max = 425984) holds ~550.
MAX_SLOTS = 512
# A hand-off that finds the peer asleep costs a kernel wake-up (~10 µs one way here, far
# more on a busy VM); a waiter first polls this long, yielding the CPU between polls so that
# on a small machine it never starves the very peer it waits for (a pure busy spin cut
# 4 KiB streaming to a fifth on 2 cores).
SPIN_S = 100e-6
# Up to this size `put` copies a contiguous CPU tensor with one memmove: a tensor view of the
# slot for torch's copy_ costs several microseconds to make, which is most of a small put.
# Larger copies go through copy_, which uses several threads.
MEMMOVE_MAX_BYTES = 64 * 1024

_ALIGN = 64
_HEADER = struct.Struct("<8sQQQ")  # magic, slots, slot bytes, creator pid
_HEADER_BYTES = 4096
_MAGIC = b"OMNIRNG1"
_MAX_MESSAGE = 16384
_ENCODER = msgspec.msgpack.Encoder()
_DOORBELL = msgspec.msgpack.Decoder(Doorbell)
_CREDIT = msgspec.msgpack.Decoder(Credit)
_CLOSED = object()

Tensors = torch.Tensor | Sequence[torch.Tensor]


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _as_tuple(tensors: Tensors) -> tuple[torch.Tensor, ...]:
    return (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)


def slot_layout(tensors: tuple[torch.Tensor, ...], slot_bytes: int, channel: object) -> list[int]:
    """Byte offsets of the tensors in a slot (64-byte aligned); PayloadTooLarge if they do
    not fit."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(_align(end))
        end = offsets[-1] + t.nbytes
    if end > slot_bytes:
        raise PayloadTooLarge(
            f"{channel}: a payload of {end} bytes ({len(tensors)} tensor(s)) does not fit a "
            f"{slot_bytes}-byte slot; the buffer plan sized this ring for smaller chunks"
        )
    return offsets


class _Deadline:
    """A wait's time limit; `None` in its place means "do not wait"."""

    __slots__ = ("at", "timeout")

    def __init__(self, timeout: float | None):
        self.timeout = timeout
        self.at = None if timeout is None else time.monotonic() + timeout

    def remaining(self, channel: object, waiting_for: str) -> float | None:
        if self.at is None:
            return None
        left = self.at - time.monotonic()
        if left <= 0:
            raise self.expired(channel, waiting_for)
        return left

    def expired(self, channel: object, waiting_for: str) -> ChannelError:
        return ChannelError(
            f"{channel}: timed out after {self.timeout} s waiting for {waiting_for}"
        )


class Received:
    """One chunk taken from a channel. Its tensors are valid until `release()` (or the end of
    a `with` block) frees the slot; `.clone()` whatever must outlive that."""

    __slots__ = ("_release", "meta", "tensors")

    def __init__(
        self, meta: ChunkMeta, tensors: tuple[torch.Tensor, ...], release: Callable[[], None]
    ):
        self.meta = meta
        self.tensors = tensors
        self._release = release

    def release(self) -> None:
        """Return the slot to the producer (idempotent)."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> Received:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _Endpoint(ABC):
    name: str
    slots: int
    slot_bytes: int
    _closed = False
    # Whether the slots are in GPU memory: then a GPU tensor goes in without a host copy.
    on_device = False

    @property
    def closed(self) -> bool:
        return self._closed

    @abstractmethod
    def close(self) -> None: ...

    def _broken(self, error: OSError | None = None) -> ChannelError:
        if self._closed:
            return ChannelError(f"{self} is closed")
        return ChannelError(
            f"{self}: the peer closed the channel or exited" + (f" ({error})" if error else "")
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, {self.slots}x{self.slot_bytes} B)"


class Producer(_Endpoint):
    """The writing end of a channel (shared-memory or in-process alike)."""

    def put(
        self, tensors: Tensors, meta: ChunkMeta, timeout: float | None = DEFAULT_TIMEOUT
    ) -> None:
        """Send one chunk, waiting up to `timeout` seconds (None: no limit) for a free slot."""
        self._put(_as_tuple(tensors), meta, _Deadline(timeout))

    def try_put(self, tensors: Tensors, meta: ChunkMeta) -> bool:
        """Send one chunk if a slot is free now; False if not."""
        return self._put(_as_tuple(tensors), meta, None)

    @abstractmethod
    def _put(
        self, tensors: tuple[torch.Tensor, ...], meta: ChunkMeta, deadline: _Deadline | None
    ) -> bool:
        """Put unless that needs a wait and `deadline` is None (then False)."""


class Consumer(_Endpoint):
    """The reading end of a channel (shared-memory or in-process alike)."""

    def get(self, timeout: float | None = DEFAULT_TIMEOUT) -> Received:
        """The next chunk, waiting up to `timeout` seconds (None: no limit)."""
        return self._get(_Deadline(timeout))

    def try_get(self) -> Received | None:
        """The next chunk if one is waiting, else None."""
        return self._get(None)

    @abstractmethod
    def _get(self, deadline: _Deadline | None) -> Received | None:
        """Get unless that needs a wait and `deadline` is None (then None)."""


# --- shared-memory ring ------------------------------------------------------------------


def _unlink_quietly(name: str) -> None:
    with suppress(FileNotFoundError):
        (SHM_DIR / name).unlink()


# Rings up to this size are populated when mapped; larger ones fault their pages in as their
# slots are first written.
POPULATE_MAX_BYTES = 64 << 20


def _map(fd: int, size: int) -> mmap.mmap:
    # MAP_POPULATE builds the page tables now, so the first messages pay no page faults; but
    # a media input's ring (omni chat's video ring is 1 GiB: 64 slots of 16 MiB) would cost
    # its creator and each producer ~0.45 s a GiB at start-up, for slots few requests use:
    # such a slot's first use in a process maps its pages then (minor faults: the creator's
    # posix_fallocate committed them, so a full /dev/shm still fails at creation).
    populate = mmap.MAP_POPULATE if size <= POPULATE_MAX_BYTES else 0
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)


class _ShmEndpoint(_Endpoint):
    # The segment is a plain /dev/shm file mapped with mmap rather than a
    # multiprocessing.shared_memory.SharedMemory: SharedMemory.close() unmaps even while torch
    # views point into it (torch keeps a reference to the buffer, not a buffer export), and on
    # Python < 3.13 attaching registers the segment with a resource tracker that unlinks it
    # when the attaching process exits. Here nothing but the creator and the janitor unlink,
    # and only reference counting unmaps.

    # What the segment's header says the ring is, and where its slots live: after the header
    # here; a device ring (device_ring.py) keeps only the header and the doorbell on the host.
    _magic = _MAGIC
    _what = "ring"

    @staticmethod
    def _host_slot_bytes(slots: int, slot_bytes: int) -> int:
        return slots * slot_bytes

    def __init__(
        self, name: str, mm: mmap.mmap, listener: socket.socket | None, sock: socket.socket | None
    ):
        """Use `create` (which passes the listening socket: this end owns the name) or `attach`."""
        _magic, slots, slot_bytes, _pid = _HEADER.unpack_from(mm)
        self.name, self.slots, self.slot_bytes, self.size = name, slots, slot_bytes, len(mm)
        self._mm = mm
        self._listener = listener
        self._sock = sock
        self._rx = bytearray(_MAX_MESSAGE)
        self._rxview = memoryview(self._rx)
        self._unlinker = weakref.finalize(self, _unlink_quietly, name) if listener else None
        if sock is not None:
            self._adopt(sock)

    @classmethod
    def create(cls, slots: int, slot_bytes: int):
        """A new ring of `slots` slots of at least `slot_bytes` bytes; the peer attaches by `.name`."""
        if not 1 <= slots <= MAX_SLOTS or slot_bytes < 1:
            raise ChannelError(
                f"a ring needs 1..{MAX_SLOTS} slots of >= 1 byte, not {slots} x {slot_bytes}"
            )
        slot_bytes = _align(slot_bytes)
        name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        size = _HEADER_BYTES + cls._host_slot_bytes(slots, slot_bytes)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind("\0" + name)
        listener.listen(1)
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Commit the pages now: a full /dev/shm then fails here, instead of as a SIGBUS on
            # some later write into a page that tmpfs cannot back.
            os.posix_fallocate(fd, 0, size)
            mm = _map(fd, size)
        except OSError as e:
            listener.close()
            _unlink_quietly(name)
            raise ChannelError(f"cannot allocate a {size}-byte ring in {SHM_DIR}: {e}") from e
        finally:
            os.close(fd)
        _HEADER.pack_into(mm, 0, cls._magic, slots, slot_bytes, os.getpid())
        return cls(name, mm, listener, None)

    @classmethod
    def attach(cls, name: str):
        """The other end of the ring `name`, made by `create()` in this or another process."""
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR)
        except FileNotFoundError:
            raise ChannelError(f"no ring segment {SHM_DIR / name}") from None
        try:
            size = os.fstat(fd).st_size
            mm = _map(fd, size) if size >= _HEADER_BYTES else None
        finally:
            os.close(fd)
        magic, slots, slot_bytes, _pid = _HEADER.unpack_from(mm) if mm else (b"", 0, 0, 0)
        if magic != cls._magic or size != _HEADER_BYTES + cls._host_slot_bytes(slots, slot_bytes):
            raise ChannelError(
                f"{SHM_DIR / name} is not an omniflow {cls._what} (or of another version)"
            )
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect("\0" + name)
        except OSError as e:
            sock.close()
            raise ChannelError(f"ring {name}: its creator is not listening ({e})") from e
        return cls(name, mm, None, sock)

    def _adopt(self, sock: socket.socket) -> None:
        # Room for one message per slot in flight keeps a credit send from ever blocking.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, (self.slots + 16) * 1024)
        # Non-blocking for good: CPython polls before every call on a socket with a timeout,
        # which would turn the spin's non-blocking attempts into blocking ones.
        sock.setblocking(False)
        self._sock = sock

    def _connection(self, deadline: _Deadline | None) -> socket.socket | None:
        """The doorbell socket; the creator accepts its peer on first use (None: not yet)."""
        if self._closed:
            raise ChannelError(f"{self} is closed")
        if self._sock is None:
            waiting_for = "the peer to attach"
            self._listener.settimeout(
                0 if deadline is None else deadline.remaining(self, waiting_for)
            )
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return None
            except TimeoutError:
                raise deadline.expired(self, waiting_for) from None
            self._listener.close()
            self._listener = None
            self._adopt(sock)
        return self._sock

    def _wait(self, event: int, deadline: _Deadline, waiting_for: str) -> None:
        """Block until the socket may be ready for `event` (or is hung up), or time is up."""
        poller = select.poll()
        poller.register(self._sock, event)
        remaining = deadline.remaining(self, waiting_for)
        poller.poll(None if remaining is None else math.ceil(remaining * 1000))

    def _recv(self, deadline: _Deadline | None, waiting_for: str) -> memoryview | None:
        """The next message from the peer (None: none yet and `deadline` is None)."""
        spin_until = time.perf_counter() + SPIN_S
        while True:
            try:
                n = self._sock.recv_into(self._rx)
            except BlockingIOError:
                if deadline is None:
                    return None
                if time.perf_counter() >= spin_until:
                    self._wait(select.POLLIN, deadline, waiting_for)
                else:
                    os.sched_yield()
                continue
            except ConnectionResetError:
                # A peer that closed with our messages unread reports that once, ahead of the
                # messages it had sent and the end of file; keep reading.
                continue
            except OSError as e:
                raise self._broken(e) from e
            if n == 0:
                raise self._broken()
            return self._rxview[:n]

    def _send(self, message: msgspec.Struct, deadline: _Deadline | None) -> bool:
        """Send one message (False: that needs a wait and `deadline` is None)."""
        data = _ENCODER.encode(message)
        if len(data) > _MAX_MESSAGE:
            raise ChannelError(
                f"{self}: a {len(data)}-byte doorbell exceeds {_MAX_MESSAGE} bytes (too many tensors?)"
            )
        while True:
            try:
                self._sock.send(data)
                return True
            except BlockingIOError:
                if deadline is None:
                    return False
                self._wait(select.POLLOUT, deadline, "room in the doorbell socket")
            except OSError as e:
                raise self._broken(e) from e

    def _view(self, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A tensor over the segment at byte `offset` (64-byte aligned, so any dtype fits)."""
        count = math.prod(shape)
        if count == 0:
            return torch.empty(shape, dtype=dtype)  # no bytes to share; frombuffer refuses count 0
        flat = torch.frombuffer(self._mm, dtype=dtype, count=count, offset=offset)
        return flat if len(shape) == 1 else flat.view(shape)

    def fileno(self) -> int:
        """What an event loop polls for this end: the doorbell socket, or until the peer has
        attached, the listener (readable when the peer connects)."""
        return (self._sock or self._listener).fileno()

    def _slot_offset(self, slot: int) -> int:
        return _HEADER_BYTES + slot * self.slot_bytes

    def unlink(self) -> None:
        """Remove the segment's name (idempotent); mappings stay valid. The creator's close() does it."""
        _unlink_quietly(self.name)
        if self._unlinker is not None:
            self._unlinker.detach()

    def close(self) -> None:
        """Close the doorbell (the peer's waits end with ChannelError), unlink if this end created
        the ring, and drop the mapping — it is unmapped once no tensor view uses it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for sock in (self._sock, self._listener):
            if sock is not None:
                with suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes a waiter in this process too
                sock.close()
        if self._unlinker is not None:
            self.unlink()
        self._mm = None


class ShmProducer(_ShmEndpoint, Producer):
    """Writes chunks into a shared-memory ring: `ShmProducer.create(slots, slot_bytes)` or
    `ShmProducer.attach(name)`."""

    def __init__(self, *args):
        super().__init__(*args)
        self._free = deque(range(self.slots))
        self._mapping = ctypes.c_char.from_buffer(self._mm)  # for memmove; close() drops it

    def _put(
        self, tensors: tuple[torch.Tensor, ...], meta: ChunkMeta, deadline: _Deadline | None
    ) -> bool:
        offsets = slot_layout(tensors, self.slot_bytes, self)
        if self._connection(deadline) is None:
            return False
        while not self._free:
            message = self._recv(deadline, "a free slot (the consumer holds them all)")
            if message is None:
                return False
            self._free.append(_CREDIT.decode(message).slot)
        slot = self._free.popleft()
        self._copy_in(self._slot_offset(slot), tensors, offsets)
        headers = tuple(
            TensorHeader(dtype_name(t.dtype), tuple(t.shape), offset)
            for t, offset in zip(tensors, offsets, strict=True)
        )
        sent = False
        try:
            sent = self._send(Doorbell(slot, meta, headers), deadline)
        finally:
            if not sent:
                self._free.appendleft(slot)
        return sent

    def _copy_in(
        self, base: int, tensors: tuple[torch.Tensor, ...], offsets: Sequence[int]
    ) -> None:
        """Copy a chunk's tensors into the slot at byte `base` (the ring's only copy)."""
        mapping = self._mapping  # held while copying: a close() from another thread cannot unmap
        for t, offset in zip(tensors, offsets, strict=True):
            if t.is_cpu and t.nbytes <= MEMMOVE_MAX_BYTES and t.is_contiguous():
                ctypes.memmove(ctypes.addressof(mapping) + base + offset, t.data_ptr(), t.nbytes)
            else:
                self._view(base + offset, t.dtype, t.shape).copy_(t)

    def close(self) -> None:
        super().close()
        self._mapping = None


class ShmConsumer(_ShmEndpoint, Consumer):
    """Reads chunks from a shared-memory ring as views of the segment:
    `ShmConsumer.attach(name)` or `ShmConsumer.create(slots, slot_bytes)`."""

    def _get(self, deadline: _Deadline | None) -> Received | None:
        if self._connection(deadline) is None:
            return None
        message = self._recv(deadline, "data from the producer")
        if message is None:
            return None
        return self._received(_DOORBELL.decode(message))

    def _received(self, bell: Doorbell) -> Received:
        """The chunk `bell` announces, as views of its slot."""
        base = self._slot_offset(bell.slot)
        tensors = tuple(
            self._view(base + h.offset, torch_dtype(h.dtype), h.shape) for h in bell.tensors
        )
        return Received(bell.meta, tensors, partial(self._release, bell.slot))

    def _release(self, slot: int) -> None:
        if self._closed:
            return
        try:
            self._sock.send(_ENCODER.encode(Credit(slot)))
        except BlockingIOError:
            # MAX_SLOTS and the send buffer size keep every credit in flight in the buffer.
            raise ChannelError(f"{self}: no room to return a credit") from None
        except OSError:
            pass  # the producer is gone: nobody needs the credit


def segment_creator(name: str) -> int | None:
    """The pid that created segment `name` (`omniflow-<pid>-<hex>`); None for another name
    (a file of the same prefix that is not a segment)."""
    pid = name[len(SEGMENT_PREFIX) :].split("-")[0] if name.startswith(SEGMENT_PREFIX) else ""
    return int(pid) if pid.isdigit() else None


def segments() -> dict[str, int]:
    """The ring segments in SHM_DIR now: each one's name and creator's pid (other files of
    the prefix left out)."""
    named = ((p.name, segment_creator(p.name)) for p in SHM_DIR.glob(SEGMENT_PREFIX + "*"))
    return {name: pid for name, pid in named if pid is not None}


def cleanup_stale_segments() -> list[str]:
    """Unlink `omniflow-*` segments whose creator process is gone; returns their names."""
    removed = []
    for name, pid in segments().items():
        if not process_alive(pid):
            _unlink_quietly(name)
            removed.append(name)
    return removed


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    # A killed child stays a zombie until reaped, and its segments are stale already.
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


# --- in-process channel -------------------------------------------------------------------


class _LocalRing:
    def __init__(self, name: str, slots: int, slot_bytes: int):
        self.name, self.slots, self.slot_bytes = name, slots, slot_bytes
        self.data: queue.SimpleQueue = queue.SimpleQueue()
        self.credits: queue.SimpleQueue = queue.SimpleQueue()
        for slot in range(slots):
            self.credits.put(slot)
        self.consumer_closed = False


def _take(q: queue.SimpleQueue, deadline: _Deadline | None, channel: object, waiting_for: str):
    """The next item of `q` (None: empty and `deadline` is None); re-queues the closed marker
    so that every waiter sees it."""
    try:
        item = q.get(False)
    except queue.Empty:
        if deadline is None:
            return None
        try:
            item = q.get(True, deadline.remaining(channel, waiting_for))
        except queue.Empty:
            raise deadline.expired(channel, waiting_for) from None
    if item is _CLOSED:
        q.put(_CLOSED)
    return item


class _LocalEndpoint(_Endpoint):
    def __init__(self, ring: _LocalRing):
        self._ring = ring
        self.name, self.slots, self.slot_bytes = ring.name, ring.slots, ring.slot_bytes

    def _close(self) -> None:
        # Both queues get the marker: it wakes the peer and any waiter on this end.
        self._closed = True
        self._ring.credits.put(_CLOSED)
        self._ring.data.put(_CLOSED)


class LocalProducer(_LocalEndpoint, Producer):
    """The writing end of an in-process channel: tensors pass by reference, so the producer must
    not modify a tensor after putting it."""

    def _put(
        self, tensors: tuple[torch.Tensor, ...], meta: ChunkMeta, deadline: _Deadline | None
    ) -> bool:
        slot_layout(tensors, self.slot_bytes, self)
        if self._closed or self._ring.consumer_closed:
            raise self._broken()
        slot = _take(
            self._ring.credits, deadline, self, "a free slot (the consumer holds them all)"
        )
        if slot is None:
            return False
        if slot is _CLOSED:
            raise self._broken()
        self._ring.data.put((slot, meta, tensors))
        return True

    def close(self) -> None:
        """Close this end; the consumer still receives what was put before. Idempotent."""
        if not self._closed:
            self._close()


class LocalConsumer(_LocalEndpoint, Consumer):
    """The reading end of an in-process channel."""

    def _get(self, deadline: _Deadline | None) -> Received | None:
        if self._closed:
            raise self._broken()
        item = _take(self._ring.data, deadline, self, "data from the producer")
        if item is None:
            return None
        if item is _CLOSED:
            raise self._broken()
        slot, meta, tensors = item
        return Received(meta, tensors, partial(self._ring.credits.put, slot))

    def close(self) -> None:
        """Close this end; the producer's next put fails with ChannelError. Idempotent."""
        if not self._closed:
            self._ring.consumer_closed = True
            self._close()


def local_channel(
    slots: int, slot_bytes: int, name: str = "local"
) -> tuple[LocalProducer, LocalConsumer]:
    """Both ends of an in-process channel with `slots` credits and `slot_bytes` per chunk."""
    if slots < 1:
        raise ChannelError(f"a channel needs at least one slot, not {slots}")
    ring = _LocalRing(name, slots, slot_bytes)
    return LocalProducer(ring), LocalConsumer(ring)
