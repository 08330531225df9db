"""Host copies in turns (omniflow/runtime/readback.py), on the CPU: what a caller that
overwrites its tensors gets back (`host_too`), how turns rotate over buffers allocated once,
several tensors under one copy, and turns of their own; `upload`'s values and dtypes, and on
a GPU that it does not wait for the stream's queued work. (The pinned buffers and the event
are CUDA's: tests/backends/test_transformers_ar.py's GPU test and the vocoders' cover them.)"""

import pytest
import torch

from omniflow.runtime.readback import IN_FLIGHT, HostCopies, HostCopy, upload


def land_late(monkeypatch, cls=HostCopy, polls: int = 3) -> list:
    """Every `cls` (a read-back: `HostCopy`, a static step's `Launched`) lands only after
    `polls` polls, as a busy GPU's would; the list it returns fills with those held back."""
    landed, held_back = cls.landed, []

    def late(copy) -> bool:
        copy.polls = getattr(copy, "polls", 0) + 1
        if copy.polls == 2:
            held_back.append(copy)
        return copy.polls > polls and landed(copy)

    monkeypatch.setattr(cls, "landed", late)
    return held_back


def test_off_cuda_a_copy_is_the_tensor_itself_unless_the_caller_overwrites_its_tensors():
    audio = torch.randn(2, 5)
    copy = HostCopies().copy(audio)
    assert copy.value is audio and copy.landed() and not copy.reused
    ids = torch.arange(4)
    copy = HostCopies(host_too=True).copy(ids)
    ids.add_(10)  # the caller's next step overwrites its buffer
    assert copy.value.tolist() == [0, 1, 2, 3] and copy.landed() and copy.reused


def test_turns_rotate_over_buffers_allocated_once_and_hand_out_leading_rows():
    """A step's buffers (the rows it stages for the device, then its ids and codes) are
    reserved whole; each turn takes the rotation's next set, the same buffers every
    IN_FLIGHT turns, as views of their leading rows, whatever the row count."""
    active, ids = torch.zeros(8, dtype=torch.bool), torch.arange(8)
    codes = torch.arange(24).view(8, 3)
    copies = HostCopies(host_too=True)
    copies.reserve(active, ids, codes)
    reserved = [[b.data_ptr() for b in turn] for turn in copies.buffers]
    assert len(reserved) == IN_FLIGHT and len({p for turn in reserved for p in turn}) == 3 * 2
    pending = []
    for step, rows in enumerate([1, 5, 8, 3]):
        turn = copies.turn()
        staged = turn.staged(active)
        staged.zero_()
        staged[[0, rows - 1]] = True
        active.copy_(staged)
        copy = turn.copy(ids[:rows], codes[:rows])
        used = [staged.data_ptr(), copy.value.data_ptr(), copy.more[0].data_ptr()]
        assert used == reserved[step % IN_FLIGHT]
        assert copy.value.shape == (rows,) and copy.more[0].shape == (rows, 3)
        pending.append((copy, ids[:rows].tolist(), codes[:rows].clone()))
        ids.add_(100)  # the next step's results, in the same device buffers
        codes.add_(100)
        if len(pending) == IN_FLIGHT:  # the oldest is taken before the next turn
            copy, want_ids, want_codes = pending.pop(0)
            assert copy.value.tolist() == want_ids and torch.equal(copy.more[0], want_codes)
    assert active.tolist() == [True, False, True] + [False] * 5
    assert [[b.data_ptr() for b in turn] for turn in copies.buffers] == reserved


def test_a_buffer_grows_only_for_a_longer_result_and_a_turn_of_its_own_keeps_nothing():
    copies = HostCopies(host_too=True)
    short = copies.copy(torch.ones(2, 4))
    copies.copy(torch.ones(1))  # the other turn
    again = copies.copy(torch.full((4, 2), 2.0))  # the first turn's buffer, reshaped
    assert again.value.data_ptr() == short.value.data_ptr() and again.value.shape == (4, 2)
    copies.copy(torch.ones(1))
    longer = copies.copy(torch.full((3, 4), 3.0))
    assert longer.value.numel() == 12 and float(longer.value.sum()) == 36.0
    before = [[b.data_ptr() for b in turn] for turn in copies.buffers]
    own = copies.turn(own=True).copy(torch.arange(3))
    assert own.value.tolist() == [0, 1, 2] and not own.reused
    assert copies.turns == 5 and [[b.data_ptr() for b in t] for t in copies.buffers] == before


def test_an_upload_is_the_values_on_the_device_in_the_dtype_asked():
    assert upload([3, 1, 2], "cpu").tolist() == [3, 1, 2]
    assert upload([3, 1, 2], "cpu").dtype == torch.int64
    codes = torch.arange(6, dtype=torch.int32).view(2, 3)
    sent = upload(codes, "cpu", torch.int64)
    assert sent.dtype == torch.int64 and torch.equal(sent, codes.long())
    assert upload([0.5], "cpu", torch.float32).dtype == torch.float32


def test_an_upload_asked_to_copy_shares_nothing_with_the_chunk_it_copies():
    chunk = torch.arange(6, dtype=torch.float32).view(2, 3)
    mine = upload(chunk, "cpu", torch.bfloat16, copy=True)
    assert mine.dtype == torch.bfloat16 and torch.equal(mine.float(), chunk)
    same = upload(chunk, "cpu", copy=True)
    chunk.zero_()  # the slot reused after the step
    assert same.data_ptr() != chunk.data_ptr() and same.sum() == 15


@pytest.mark.gpu
def test_an_upload_does_not_wait_for_the_streams_queued_work():
    """A copy from pageable memory waits for the work queued on the stream; `upload` returns
    while a long kernel still runs, and the values arrive after it, in order."""
    queued = torch.cuda.Event()
    torch.cuda._sleep(2_000_000_000)  # about a second of spinning on the current stream
    queued.record()
    ids = upload([5, 6, 7], "cuda")
    codes = upload(torch.arange(4, dtype=torch.int32), "cuda", torch.int64)
    assert not queued.query(), "upload waited for the stream's queued kernel"
    host = torch.ones(2, 3)
    rows = upload(host, "cuda", torch.bfloat16, copy=True)  # a ring's chunk
    assert not queued.query(), "a copying upload waited for the queued kernel"
    host.zero_()  # the ring's slot reused
    assert ids.tolist() == [5, 6, 7] and codes.tolist() == [0, 1, 2, 3]
    assert rows.dtype == torch.bfloat16 and rows.float().sum().item() == 6
    torch.cuda._sleep(2_000_000_000)
    queued.record()
    torch.tensor([5, 6, 7], device="cuda")  # what upload replaces: it waits
    assert queued.query()
