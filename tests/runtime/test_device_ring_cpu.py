"""What of the device ring runs without a GPU: the IPC handle's trip through the segment's
header page, NUL bytes and all (the GPU tests in test_device_ring.py cover the rest)."""

import pytest

from omniflow.errors import ChannelError
from omniflow.runtime.device_ring import IpcHandle, _CuIpcMemHandle


def test_an_ipc_handle_keeps_every_byte_through_ctypes_and_msgpack():
    import msgspec

    raw = bytes([0, 7, 0, 0, 255] * 12 + [0, 0, 1, 0])  # 64 bytes with NULs inside and at the end
    handle = IpcHandle(3, bytes(_CuIpcMemHandle.of(raw)), 1 << 30)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(handle), type=IpcHandle) == handle
    assert handle.handle == raw


def test_a_handle_of_the_wrong_size_is_refused():
    with pytest.raises(ChannelError, match="64 bytes, not 63"):
        _CuIpcMemHandle.of(bytes(63))
