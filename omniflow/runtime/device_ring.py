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
- Ordering: the producer waits for its copy before it rings (the consumer may read at
  once), and the consumer waits for the work queued on its current stream before it hands
  the slot back (the producer may overwrite at once). A GPU tensor never visits the host.
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
from omniflow.runtime.shm_ring import ShmConsumer, ShmProducer

# Where the IPC handle sits in the segment's header page: after the ring's own header.
_HANDLE_AT = 512
_HANDLE_LEN = struct.Struct("<I")
_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class IpcHandle(msgspec.Struct, frozen=True, array_like=True):
    """What the creator publishes: the GPU (its index on this host), the CUDA IPC handle of
    the allocation, and the allocation's size."""

    device: int
    handle: bytes
    size: int


class _CuIpcMemHandle(ctypes.Structure):
    # Bytes, not c_char: a c_char array reads back cut at its first NUL, and handles hold NULs.
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]

    @classmethod
    def of(cls, handle: bytes) -> _CuIpcMemHandle:
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
            lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_CuIpcMemHandle), ptr]
            lib.cuIpcOpenMemHandle_v2.argtypes = [
                ctypes.POINTER(ptr),
                _CuIpcMemHandle,
                ctypes.c_uint,
            ]
            lib.cuIpcCloseMemHandle.argtypes = [ptr]
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
        raw = _CuIpcMemHandle.of(handle.handle)
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
        raw = _CuIpcMemHandle()
        with _on(self.device):
            _check(_cuda().cuIpcGetMemHandle(ctypes.byref(raw), self.pointer), "cuIpcGetMemHandle")
        return IpcHandle(self.device, bytes(raw), self.size)

    def tensor(self) -> torch.Tensor:
        with torch.cuda.device(self.device):
            return torch.as_tensor(self, device=f"cuda:{self.device}")


def _release(release, device: int, pointer: int) -> None:
    # At interpreter exit the driver may be shutting down: the process's exit frees it anyway.
    try:
        with torch.cuda.device(device):
            release(pointer)
    except Exception:  # noqa: BLE001, S110 (nothing to tell anyone at exit)
        pass


class _on(torch.cuda.device):
    """`torch.cuda.device` that also makes sure the device's primary context exists (the
    driver calls run in whatever context is current)."""

    def __enter__(self):
        super().__enter__()
        torch.cuda.synchronize(self.idx)  # creates the primary context on first use


def _device_index(device: str | int) -> int:
    if isinstance(device, int):
        return device
    parsed = torch.device(local_name(device))
    if parsed.type != "cuda":
        raise ChannelError(f"a device ring needs a CUDA device, not {device}")
    return parsed.index or 0


class _DeviceRing:
    """What both device endpoints add to their shm twin: where the slots are."""

    on_device = True
    _magic = b"OMNIDEV1"
    _what = "device ring"
    _memory: _DeviceMemory
    _buffer: torch.Tensor

    @staticmethod
    def _host_slot_bytes(slots: int, slot_bytes: int) -> int:
        return 0  # the segment is the header page alone

    @classmethod
    def create(cls, slots: int, slot_bytes: int, device: str | int = 0):
        """A new ring of `slots` slots of at least `slot_bytes` bytes in `device`'s memory."""
        ring = super().create(slots, slot_bytes)
        try:
            ring._adopt_memory(
                _DeviceMemory.allocate(_device_index(device), ring.slots * ring.slot_bytes)
            )
            data = msgspec.msgpack.encode(ring._memory.ipc_handle())
            _HANDLE_LEN.pack_into(ring._mm, _HANDLE_AT, len(data))
            ring._mm[_HANDLE_AT + 4 : _HANDLE_AT + 4 + len(data)] = data
        except BaseException:
            ring.close()
            raise
        return ring

    @classmethod
    def attach(cls, name: str):
        """The other end of the device ring `name`: opens its memory through the IPC handle."""
        ring = super().attach(name)
        try:
            (size,) = _HANDLE_LEN.unpack_from(ring._mm, _HANDLE_AT)
            data = bytes(ring._mm[_HANDLE_AT + 4 : _HANDLE_AT + 4 + size])
            ring._adopt_memory(_DeviceMemory.open(msgspec.msgpack.decode(data, type=IpcHandle)))
        except BaseException:
            ring.close()
            raise
        return ring

    def _adopt_memory(self, memory: _DeviceMemory) -> None:
        self._memory = memory
        self._buffer = memory.tensor()
        self.device = self._buffer.device

    def _slot_offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def _view(self, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        size = dtype.itemsize * math.prod(shape)
        return self._buffer[offset : offset + size].view(dtype).view(shape)

    def close(self) -> None:
        super().close()
        # The memory goes once no view of it is left (as the shm ring's mapping does).
        self._buffer = None
        self._memory = None


class DeviceProducer(_DeviceRing, ShmProducer):
    """Writes chunks into a device ring: GPU tensors by a device (or peer) copy, CPU tensors
    by a host-to-device copy."""

    def _copy_in(
        self, base: int, tensors: tuple[torch.Tensor, ...], offsets: Sequence[int]
    ) -> None:
        with torch.cuda.device(self.device):
            for t, offset in zip(tensors, offsets, strict=True):
                self._view(base + offset, t.dtype, t.shape).copy_(t)
            # The consumer may read as soon as it hears the doorbell.
            torch.cuda.current_stream().synchronize()


class DeviceConsumer(_DeviceRing, ShmConsumer):
    """Reads chunks from a device ring as views of its GPU memory."""

    def _release(self, slot: int) -> None:
        if self._buffer is not None:
            # Work queued on the slot's views must be done before the producer overwrites it.
            torch.cuda.current_stream(self.device).synchronize()
        super()._release(slot)
