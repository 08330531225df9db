"""Moving a step's values between host and GPU without waiting for the GPU: results read
back (`HostCopies`), inputs sent (`upload`).

A stage that needs a step's results on the host (sampled ids, audio to send) must not wait
for its GPU: the executor's loop drives every stage of its process from one thread, so a
host wait in one stage's step stalls the others sharing the GPU (docs/architecture.md, "One
GPU, one process"). `HostCopies` owns the pinned host buffers those results arrive in:
IN_FLIGHT turns of them, used in rotation, each buffer allocated once (`reserve`, or at its
first use) and grown only for a longer result. A turn (`HostTurn`) hands out its buffers in
the order asked for: first any the host writes for the device to read (`staged`: a step's
inputs, copied host to device), then `copy` queues a non-blocking copy of each device
tensor given into the next ones and records one event after them on the current stream (the
stage's own, which the loop has entered): `HostCopy.landed` asks the event, never waits.
The stage keeps the copy pending and takes it in a later step, once it has landed;
meanwhile the loop keeps turning (`Backend.in_flight`). A turn of its own (`turn(own=True)`,
or `to_host`) keeps nothing: its buffers are new pinned ones, which torch's caching host
allocator reuses only once the copies that used them are done, so any number may be in
flight.

Off CUDA a tensor is already on the host: `copy` hands it back as it is, landed; a caller
that overwrites its tensors before it takes their copies (a static decode step's output
buffers) asks for copies of host tensors too, `HostCopies(host_too=True)`, into the turn's
unpinned buffers.

The other direction has the same trap: a copy to the GPU from pageable host memory (what
`torch.tensor(values, device=...)` and `.to(device)` of a host tensor do) waits for all the
work queued on the current stream before it returns. `upload` copies through a pinned
staging tensor without blocking; torch's caching host allocator keeps that tensor until its
copy is done.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from omniflow.runtime.sync_debug import name_wait


def upload(
    values, device: torch.device | str, dtype: torch.dtype | None = None, copy: bool = False
) -> torch.Tensor:
    """`values` (a tensor, or a list of numbers) on `device` as `dtype`; from the host to a
    GPU, copied without waiting for the device's queued work (see the module docstring).
    With `copy`, a tensor the caller owns even where no copy was needed (a chunk that may be
    a view into a channel slot released after the step)."""
    device = torch.device(device)
    on_host = not isinstance(values, torch.Tensor) or values.device.type == "cpu"
    if device.type != "cuda" or not on_host:
        if copy and isinstance(values, torch.Tensor):
            return values.to(device=device, dtype=dtype or values.dtype, copy=True)
        return torch.as_tensor(values, dtype=dtype, device=device)
    if isinstance(values, torch.Tensor):
        staged = torch.empty(values.shape, dtype=dtype or values.dtype, pin_memory=True)
        staged.copy_(values)
    else:
        staged = torch.tensor(values, dtype=dtype, pin_memory=True)
    return staged.to(device, non_blocking=True)


# Turns pending at once, at most: each has its own host buffers, reused once it is taken.
IN_FLIGHT = 2


@dataclass
class HostCopy:
    """Device tensors' copies on the host, valid once `landed`: `value`, the first tensor
    given, and `more`, the others (copied under the same event). A value in a reused buffer
    (`reused`) is overwritten by a later turn's copy: clone what outlives it."""

    value: torch.Tensor
    done: torch.cuda.Event | None = None
    more: tuple[torch.Tensor, ...] = ()
    reused: bool = False

    def landed(self) -> bool:
        """Whether the copy has arrived: asked of its event, never waited for."""
        return self.done is None or self.done.query()

    def wait(self) -> None:
        """Wait for the copy to arrive (a caller that takes only landed ones never waits;
        one that would is named under OMNIFLOW_SYNC_DEBUG, sync_debug.py)."""
        if self.done is not None:
            if not self.done.query():
                name_wait("a read-back still on its way (HostCopy.wait)")
            self.done.synchronize()


class HostTurn:
    """One turn's host buffers, handed out in the order asked for (the same order every
    turn, so each use gets its own buffer back); `copy` ends the turn."""

    def __init__(self, buffers: list[torch.Tensor], host_too: bool, reused: bool):
        self.buffers = buffers
        self.host_too = host_too
        self.reused = reused
        self.used = 0

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        """The turn's next buffer, shaped like `like`: pinned where `like` is on CUDA."""
        i, n = self.used, like.numel()
        self.used += 1
        if i == len(self.buffers):
            self.buffers.append(_allocate(like))
        buffer = self.buffers[i]
        if buffer.dtype != like.dtype or buffer.numel() < n:
            buffer = self.buffers[i] = _allocate(like)
        if buffer.shape == like.shape:
            return buffer
        if like.dim() and buffer.shape[1:] == like.shape[1:] and len(buffer) >= len(like):
            return buffer[: like.shape[0]]  # (its leading rows: one view, no reshape)
        return buffer.view(-1)[:n].view(like.shape)

    def staged(self, target: torch.Tensor) -> torch.Tensor:
        """A host buffer shaped like the device tensor `target`, for the host to write and
        copy into it without blocking. Safe to overwrite in a later turn: the turn that
        reuses this buffer comes only after this one's copy was taken, and its event,
        recorded after the host-to-device copy on the same stream, says that copy is done."""
        return self._buffer(target)

    def copy(self, *tensors: torch.Tensor) -> HostCopy:
        """Queue a copy of each of `tensors` into the turn's next buffers and record one
        event after them on the current stream (off CUDA: the host tensors as they are,
        unless the turn keeps host tensors too)."""
        if not tensors[0].is_cuda and not self.host_too:
            return HostCopy(tensors[0], None, tensors[1:])
        hosts = []
        for tensor in tensors:
            host = self._buffer(tensor)
            host.copy_(tensor, non_blocking=tensor.is_cuda)
            hosts.append(host)
        done = None
        if tensors[0].is_cuda:
            done = torch.cuda.Event()
            done.record()
        return HostCopy(hosts[0], done, tuple(hosts[1:]), self.reused)


def _allocate(like: torch.Tensor) -> torch.Tensor:
    """A host buffer shaped like `like`: pinned where `like` is on CUDA."""
    return torch.empty(like.shape, dtype=like.dtype, pin_memory=like.is_cuda)


def to_host(*tensors: torch.Tensor) -> HostCopy:
    """Copies of `tensors` on the host in new pinned buffers of their own (a turn of its own,
    kept nowhere: any number may be pending); off CUDA, the tensors as they are."""
    return HostTurn([], host_too=False, reused=False).copy(*tensors)


class Awaited:
    """Requests that wait for a copy to the host before they go on (a talker's prompt
    markers, a thinker's media headers, a denoiser's prompt lengths): in flight until each
    has taken its copy or stopped running, so that the loop keeps polling meanwhile (a
    backend's `in_flight`; until taken, not until landed: a copy that lands between the
    loop's asking whether the request is ready and whether anything is in flight would
    otherwise leave it waiting for nothing)."""

    def __init__(self) -> None:
        self.calls: list[weakref.ref] = []

    def landed(self, call, key: str, start: Callable[[], tuple]) -> bool:
        """Whether `call` (a `Call`) may go on: on the first ask, `start()` gives what the
        request keeps until it takes it (`call.state[key]`), the copy it waits for last (a
        `HostCopy`; anything else, such as None or an error, waits for nothing); then
        whether that copy has landed."""
        kept = call.state.get(key)
        if kept is None:
            kept = call.state[key] = start()
            if isinstance(kept[-1], HostCopy):
                self.add(call)
        return not isinstance(kept[-1], HostCopy) or kept[-1].landed()

    def take(self, call, key: str) -> tuple:
        """What `call` kept (`landed`), its copy on the host: taken."""
        self.taken(call)
        return call.state.pop(key)

    def add(self, call) -> None:
        """`call` (a `Call`) waits for a copy."""
        self.calls.append(weakref.ref(call))

    def taken(self, call) -> None:
        """`call` has taken its copy."""
        self.calls = [ref for ref in self.calls if ref() is not call]

    def in_flight(self) -> bool:
        def waiting(call) -> bool:
            return call is not None and call.running

        self.calls = [ref for ref in self.calls if waiting(ref())]
        return bool(self.calls)


class HostCopies:
    """IN_FLIGHT turns of host buffers, used in rotation; the caller takes each turn's copy
    before it starts IN_FLIGHT more (the turn that reuses its buffers)."""

    def __init__(self, host_too: bool = False):
        self.host_too = host_too
        self.buffers: list[list[torch.Tensor]] = [[] for _ in range(IN_FLIGHT)]
        self.turns = 0

    def reserve(self, *likes: torch.Tensor) -> None:
        """Allocate every turn's buffers now, shaped like `likes` in the order a turn asks
        for them, so that no turn allocates (a turn may still ask for smaller ones)."""
        for buffers in self.buffers:
            buffers[:] = [_allocate(like) for like in likes]

    def turn(self, own: bool = False) -> HostTurn:
        """The next turn in the rotation, or with `own` one of buffers of its own (new ones,
        not kept: any number of those may be pending)."""
        if own:
            return HostTurn([], self.host_too, reused=False)
        buffers = self.buffers[self.turns % IN_FLIGHT]
        self.turns += 1
        return HostTurn(buffers, self.host_too, reused=True)

    def copy(self, *tensors: torch.Tensor) -> HostCopy:
        """A turn of nothing but `tensors`' copies (see `HostTurn.copy`)."""
        return self.turn().copy(*tensors)
