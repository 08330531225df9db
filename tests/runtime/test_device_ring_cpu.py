"""What of the device ring runs without a GPU: the published record's trip through the
segment's header page (IPC handles of the memory and of every slot's events), NUL bytes and
all (the GPU tests in test_device_ring.py cover the rest); and the reference of their engine test."""

import msgspec
import pytest
import torch

from omniflow.errors import ChannelError
from omniflow.runtime import device_ring, shm_ring
from omniflow.runtime.device_ring import DeviceConsumer, IpcHandle, _CuIpcHandle
from omniflow.runtime.interpreter import Interpreter
from tests.runtime.test_device_ring import cuda_ipc_plan

RAW = bytes([0, 7, 0, 0, 255] * 12 + [0, 0, 1, 0])  # 64 bytes with NULs inside and at the end


def test_an_ipc_handle_keeps_every_byte_through_ctypes_and_msgpack():
    handle = IpcHandle(3, bytes(_CuIpcHandle.of(RAW)), 1 << 30, events=(RAW, RAW[::-1]))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(handle), type=IpcHandle) == handle
    assert handle.handle == RAW


@pytest.mark.parametrize("slots", [1, 7, shm_ring.MAX_SLOTS])
def test_the_record_of_every_slots_events_fits_the_segment(slots):
    record = IpcHandle(0, RAW, 1 << 40, events=(RAW,) * (2 * slots))
    end = device_ring._HANDLE_AT + 4 + len(msgspec.msgpack.encode(record))
    assert end <= shm_ring._HEADER_BYTES + DeviceConsumer._host_slot_bytes(slots, 1 << 20)


def test_a_handle_of_the_wrong_size_is_refused():
    with pytest.raises(ChannelError, match="64 bytes, not 63"):
        _CuIpcHandle.of(bytes(63))


def test_the_gpu_engine_tests_reference_runs_on_the_cpu():
    """The cuda-ipc plan of test_device_ring.py's engine test, under the interpreter on its
    stand-ins: the replies that test compares its engine's with."""
    reference = Interpreter(cuda_ipc_plan(), "standin")
    for text in ("good morning", "hi"):
        audio = reference.run({"text": text})["audio"]
        assert audio.dtype == torch.int16 and audio.shape[0] > 0  # the graph's pcm16
