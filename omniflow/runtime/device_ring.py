"""Device rings: the `cuda-ipc` and `p2p` channels, whose slots live in GPU memory.

A device ring is the shared-memory ring of shm_ring.py with its slots moved to a GPU: the
same segment header (geometry, creator pid) — holding no slots, only the ring's CUDA IPC
handle after the header — the same doorbell socket, `Doorbell`/`Credit` messages, slot
layout, credits and backpressure. Nothing of it is copied here: `DeviceProducer` and
`DeviceConsumer` are the shm endpoints with a different place for the bytes.

- Memory: the creator (the consumer, at link time, as for every ring) allocates
  `slots x slot_bytes` on the channel's GPU with the CUDA driver (`cuMemAlloc`, outside
  torch's caching allocator, so that closing the ring gives the memory back to the device,
  not to a cache) and publishes `cuIpcGetMemHandle`'s handle in the segment's header page.
  The peer opens it once when it attaches (again after a re-link). Both ends see the slots
  as one uint8 tensor on that GPU; a slot's tensors are views of it.
- `cuda-ipc` and `p2p` are the same code: the producer opens the ring on the ring's GPU
  (with peer access enabled lazily, the driver's `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`), and
  torch's `copy_` from the producer's tensor is a device-to-device copy when both are on
  one GPU and a peer copy when they are not.
- Ordering, on the GPU: neither end ever waits for the GPU on the host. The creator also
  makes two interprocess CUDA events per slot, `filled` and `freed`, published beside the
  memory's handle. The producer's stream waits for the slot's `freed` (the consumer's work
  on the previous chunk in it), copies, and records `filled` before the doorbell goes; the
  consumer's stream waits for `filled` before the views are handed out, and `freed` is
  recorded on it before the credit goes back. A record always precedes the message that
  lets the peer wait for it, so a wait sees the right record. A contiguous tensor on the
  ring's GPU is copied with one `cuMemcpyAsync` (torch's `copy_` costs several
  microseconds of dispatch per put); anything else (a host tensor, another GPU's) with
  `copy_` on the same stream. A GPU tensor never visits the host. A wait or record with
  nothing to order is skipped (the event has completed, the stream is idle), and a
  consumer with nothing queued waits for a running copy on the host: each GPU-side wait or
  record is work in one more process's context, and without MPS the contexts of processes
  take turns on the GPU (a switch costs tens of microseconds).
- Hot path: driver calls on the ring GPU's current raw stream in the calling thread's
  current context; only where that fails (a thread with no context yet, or another GPU's
  current) is the call repeated under a device guard, which costs ~9 us a put.
- Lifetimes: the memory is freed (`cuMemFree`, `cuIpcCloseMemHandle` on the other side)
  when the endpoint is closed and the last tensor view of it is gone, as for the shm ring's
  mapping. A process that dies gives its allocations and mappings back to the driver; the
  header segment is a plain shm segment, removed by `cleanup_stale_segments()`.
"""

from __future__ import annotations

import ctypes
import math
import struct
import threading
import weakref
from collections.abc import Sequence

import msgspec
import torch

from omniflow.devices import local_name
from omniflow.errors import ChannelError
from omniflow.runtime.doorbells import Doorbell
from omniflow.runtime.shm_ring import Received, ShmConsumer, ShmProducer

# Where the IPC handle sits in the segment's header page: after the ring's own header.
_HANDLE_AT = 512
_HANDLE_LEN = struct.Struct("<I")
_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
# The room the published record takes beyond the header page: two event handles a slot.
_EVENT_HANDLE_BYTES = 80
_CU_EVENT_DISABLE_TIMING, _CU_EVENT_INTERPROCESS = 0x2, 0x4


class IpcHandle(msgspec.Struct, frozen=True, array_like=True):
    """What the creator publishes: the GPU (its index on this host), the CUDA IPC handle of
    the allocation, the allocation's size, and the IPC handles of the slots' `filled`
    events, then of their `freed` events."""

    device: int
    handle: bytes
    size: int
    events: tuple[bytes, ...] = ()


class _CuIpcHandle(ctypes.Structure):
    """`CUipcMemHandle` and `CUipcEventHandle` (both 64 opaque bytes)."""

    # Bytes, not c_char: a c_char array reads back cut at its first NUL, and handles hold NULs.
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]

    @classmethod
    def of(cls, handle: bytes) -> _CuIpcHandle:
        if len(handle) != ctypes.sizeof(cls):
            raise ChannelError(
                f"a CUDA IPC handle has {ctypes.sizeof(cls)} bytes, not {len(handle)}"
            )
        return cls.from_buffer_copy(handle)


_driver = None
_driver_lock = threading.Lock()


def _cuda():
    """The CUDA driver library, its signatures declared (loaded on first use: importing this
    module needs no GPU)."""
    global _driver
    with _driver_lock:
        if _driver is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as err:
                raise ChannelError(f"device rings need the CUDA driver: {err}") from err
            ptr = ctypes.c_uint64
            lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ptr), ctypes.c_size_t]
            lib.cuMemFree_v2.argtypes = [ptr]
            lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_CuIpcHandle), ptr]
            lib.cuIpcOpenMemHandle_v2.argtypes = [
                ctypes.POINTER(ptr),
                _CuIpcHandle,
                ctypes.c_uint,
            ]
            lib.cuIpcCloseMemHandle.argtypes = [ptr]
            handle = ctypes.c_void_p  # CUevent, CUstream
            lib.cuEventCreate.argtypes = [ctypes.POINTER(handle), ctypes.c_uint]
            lib.cuEventDestroy_v2.argtypes = [handle]
            lib.cuEventRecord.argtypes = [handle, handle]
            lib.cuStreamWaitEvent.argtypes = [handle, handle, ctypes.c_uint]
            lib.cuIpcGetEventHandle.argtypes = [ctypes.POINTER(_CuIpcHandle), handle]
            lib.cuIpcOpenEventHandle.argtypes = [ctypes.POINTER(handle), _CuIpcHandle]
            lib.cuMemcpyAsync.argtypes = [ptr, ptr, ctypes.c_size_t, handle]
            lib.cuEventQuery.argtypes = [handle]
            lib.cuEventSynchronize.argtypes = [handle]
            lib.cuStreamQuery.argtypes = [handle]
            lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            _driver = lib
    return _driver


def _check(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _cuda().cuGetErrorString(result, ctypes.byref(text))
        name = text.value.decode() if text.value else f"error {result}"
        raise ChannelError(f"{what} failed: {name}")


class _DeviceMemory:
    """One allocation made here (`allocate`) or opened from another process (`open`); freed
    or closed when this object is collected -- after the endpoint and every view of it."""

    def __init__(self, device: int, pointer: int, size: int, opened: bool):
        self.device, self.pointer, self.size = device, pointer, size
        release = _cuda().cuIpcCloseMemHandle if opened else _cuda().cuMemFree_v2
        weakref.finalize(self, _release, release, device, pointer)
        # `__cuda_array_interface__` lets torch wrap the memory without copying; the tensor
        # keeps this object (and so the memory) alive.
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (pointer, False),
            "version": 3,
        }

    @classmethod
    def allocate(cls, device: int, size: int) -> _DeviceMemory:
        with _on(device):
            pointer = ctypes.c_uint64()
            _check(_cuda().cuMemAlloc_v2(ctypes.byref(pointer), size), f"allocating {size} bytes")
        return cls(device, pointer.value, size, opened=False)

    @classmethod
    def open(cls, handle: IpcHandle) -> _DeviceMemory:
        raw = _CuIpcHandle.of(handle.handle)
        with _on(handle.device):
            pointer = ctypes.c_uint64()
            _check(
                _cuda().cuIpcOpenMemHandle_v2(
                    ctypes.byref(pointer), raw, _CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
                ),
                "opening a device ring's IPC handle",
            )
        return cls(handle.device, pointer.value, handle.size, opened=True)

    def ipc_handle(self) -> IpcHandle:
        raw = _CuIpcHandle()
        with _on(self.device):
            _check(_cuda().cuIpcGetMemHandle(ctypes.byref(raw), self.pointer), "cuIpcGetMemHandle")
        return IpcHandle(self.device, bytes(raw), self.size)

    def tensor(self) -> torch.Tensor:
        with torch.cuda.device(self.device):
            return torch.as_tensor(self, device=f"cuda:{self.device}")


class _SlotEvents:
    """Each slot's `filled` and `freed` interprocess events, made here (`create`) or opened
    from the creator's handles (`open`, in `handles()`'s order); destroyed when this object
    is collected."""

    def __init__(self, device: int):
        self.filled: list[int] = []
        self.freed: list[int] = []
        weakref.finalize(self, _destroy_events, device, self.filled, self.freed)

    @classmethod
    def create(cls, device: int, slots: int) -> _SlotEvents:
        made = cls(device)
        flags = _CU_EVENT_DISABLE_TIMING | _CU_EVENT_INTERPROCESS
        with _on(device):
            for events in (made.filled, made.freed):
                for _ in range(slots):
                    event = ctypes.c_void_p()
                    _check(_cuda().cuEventCreate(ctypes.byref(event), flags), "cuEventCreate")
                    events.append(event.value)
        return made

    @classmethod
    def open(cls, device: int, handles: Sequence[bytes]) -> _SlotEvents:
        opened = cls(device)
        slots = len(handles) // 2
        with _on(device):
            for i, handle in enumerate(handles):
                event = ctypes.c_void_p()
                _check(
                    _cuda().cuIpcOpenEventHandle(ctypes.byref(event), _CuIpcHandle.of(handle)),
                    "opening a device ring's slot event",
                )
                (opened.filled if i < slots else opened.freed).append(event.value)
        return opened

    def handles(self) -> tuple[bytes, ...]:
        handles = []
        for event in (*self.filled, *self.freed):
            raw = _CuIpcHandle()
            _check(_cuda().cuIpcGetEventHandle(ctypes.byref(raw), event), "cuIpcGetEventHandle")
            handles.append(bytes(raw))
        return tuple(handles)


def _destroy_events(device: int, *lists: list[int]) -> None:
    for events in lists:
        for event in events:
            _release(_cuda().cuEventDestroy_v2, device, event)


def _release(release, device: int, handle: int) -> None:
    """`release(handle)` on `device`; at interpreter exit the driver may be shutting down,
    and the process's exit frees the memory or event anyway."""
    try:
        with torch.cuda.device(device):
            release(handle)
    except Exception:  # noqa: BLE001, S110 (nothing to tell anyone at exit)
        pass


class _on(torch.cuda.device):
    """`torch.cuda.device` that also makes sure the device's primary context exists (the
    driver calls run in whatever context is current)."""

    def __enter__(self):
        super().__enter__()
        torch.cuda.synchronize(self.idx)  # creates the primary context on first use


def _raw_stream(index: int) -> int:
    # torch's cheapest way to the current stream (what its compiled kernels launch on): a
    # Stream object costs several microseconds a put. CUDA builds only, so looked up here.
    return torch._C._cuda_getCurrentRawStream(index)


def _device_index(device: str | int) -> int:
    if isinstance(device, int):
        return device
    parsed = torch.device(local_name(device))
    if parsed.type != "cuda":
        raise ChannelError(f"a device ring needs a CUDA device, not {device}")
    return parsed.index or 0


class _DeviceRing:
    """What both device endpoints add to their shm twin: where the slots are, and each
    slot's events."""

    on_device = True
    _magic = b"OMNIDEV2"
    _what = "device ring"
    _memory: _DeviceMemory
    _buffer: torch.Tensor
    _events: _SlotEvents

    @staticmethod
    def _host_slot_bytes(slots: int, slot_bytes: int) -> int:
        return 2 * slots * _EVENT_HANDLE_BYTES  # the published record's room: no slots here

    @classmethod
    def create(cls, slots: int, slot_bytes: int, device: str | int = 0):
        """A new ring of `slots` slots of at least `slot_bytes` bytes in `device`'s memory."""
        ring = super().create(slots, slot_bytes)
        try:
            index = _device_index(device)
            ring._adopt_device(
                _DeviceMemory.allocate(index, ring.slots * ring.slot_bytes),
                _SlotEvents.create(index, ring.slots),
            )
            record = msgspec.structs.replace(
                ring._memory.ipc_handle(), events=ring._events.handles()
            )
            data = msgspec.msgpack.encode(record)
            _HANDLE_LEN.pack_into(ring._mm, _HANDLE_AT, len(data))
            ring._mm[_HANDLE_AT + 4 : _HANDLE_AT + 4 + len(data)] = data
        except BaseException:
            ring.close()
            raise
        return ring

    @classmethod
    def attach(cls, name: str):
        """The other end of the device ring `name`: opens its memory and events through their
        IPC handles."""
        ring = super().attach(name)
        try:
            (size,) = _HANDLE_LEN.unpack_from(ring._mm, _HANDLE_AT)
            data = bytes(ring._mm[_HANDLE_AT + 4 : _HANDLE_AT + 4 + size])
            record = msgspec.msgpack.decode(data, type=IpcHandle)
            ring._adopt_device(
                _DeviceMemory.open(record), _SlotEvents.open(record.device, record.events)
            )
        except BaseException:
            ring.close()
            raise
        return ring

    def _adopt_device(self, memory: _DeviceMemory, events: _SlotEvents) -> None:
        self._memory, self._events = memory, events
        self._index = memory.device
        self._buffer = memory.tensor()
        self.device = self._buffer.device

    def _slot_offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def _view(self, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        size = dtype.itemsize * math.prod(shape)
        return self._buffer[offset : offset + size].view(dtype).view(shape)

    def _stream(self) -> int:
        """The ring GPU's current stream in this thread, as the driver's handle."""
        return _raw_stream(self._index)

    def _driver(self, what: str, call, *args) -> None:
        """A driver call on the ring's GPU: in this thread's current context, else (none yet,
        or another GPU's) again under a device guard."""
        result = call(*args)
        if result != 0:
            with torch.cuda.device(self._index):
                result = call(*args)
        _check(result, what)

    def close(self) -> None:
        super().close()
        # The memory goes once no view of it is left (as the shm ring's mapping does); the
        # events once no endpoint holds them.
        self._buffer = None
        self._memory = None
        self._events = None


class DeviceProducer(_DeviceRing, ShmProducer):
    """Writes chunks into a device ring: GPU tensors by a device (or peer) copy, CPU tensors
    by a host-to-device copy, all queued on the ring GPU's current stream."""

    def _copy_in(
        self, base: int, tensors: tuple[torch.Tensor, ...], offsets: Sequence[int]
    ) -> None:
        slot = base // self.slot_bytes
        cuda, stream = _cuda(), self._stream()
        freed = self._events.freed[slot]
        if cuda.cuEventQuery(freed) != 0:
            self._driver("waiting for a slot event", cuda.cuStreamWaitEvent, stream, freed, 0)
        for t, offset in zip(tensors, offsets, strict=True):
            if t.device == self.device and t.is_contiguous():
                if t.nbytes:
                    pointer = self._memory.pointer + base + offset
                    self._driver(
                        "copying into a device ring",
                        cuda.cuMemcpyAsync, pointer, t.data_ptr(), t.nbytes, stream,
                    )  # fmt: skip
            else:
                with torch.cuda.device(self.device):
                    self._view(base + offset, t.dtype, t.shape).copy_(t)
        self._driver(
            "recording a slot event", cuda.cuEventRecord, self._events.filled[slot], stream
        )


class DeviceConsumer(_DeviceRing, ShmConsumer):
    """Reads chunks from a device ring as views of its GPU memory, ready for the work queued
    after them on the ring GPU's current stream."""

    def _received(self, bell: Doorbell) -> Received:
        cuda, filled = _cuda(), self._events.filled[bell.slot]
        if cuda.cuEventQuery(filled) != 0:
            stream = self._stream()
            if cuda.cuStreamQuery(stream) == 0:
                # Nothing queued here to overlap the copy with: waiting on the host (for a
                # copy already running) keeps this process's context off the GPU.
                self._driver("waiting for a chunk's copy", cuda.cuEventSynchronize, filled)
            else:
                wait = cuda.cuStreamWaitEvent
                self._driver("waiting for a slot event", wait, stream, filled, 0)
        return super()._received(bell)

    def _release(self, slot: int) -> None:
        if self._events is not None:
            # The producer's next copy into the slot waits for the work queued on its views.
            cuda, stream = _cuda(), self._stream()
            if cuda.cuStreamQuery(stream) != 0:
                freed = self._events.freed[slot]
                self._driver("recording a slot event", cuda.cuEventRecord, freed, stream)
        super()._release(slot)
