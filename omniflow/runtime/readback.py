"""Reading results back from a GPU without waiting for it.

A stage that needs a step's results on the host (sampled ids, audio to send) must not wait
for its GPU: the executor's loop drives every stage of its process from one thread, so a
host wait in one stage's step stalls the others sharing the GPU (docs/architecture.md, "One
GPU, one process"). `HostCopies.copy` queues a non-blocking copy of a device tensor into a
pinned host buffer, allocated once and grown only for a longer result, and records an event
after it on the current stream (the stage's own, which the loop has entered): `landed` asks
the event, never waits. The stage keeps the copy pending and takes it in a later step, once
it has landed; meanwhile the loop keeps turning (`Backend.in_flight`).

Off CUDA a tensor is already on the host: `copy` hands it back as it is, landed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Copies pending at once, at most: each has its own host buffer, reused once it is taken.
IN_FLIGHT = 2


@dataclass
class HostCopy:
    """A device tensor's copy on the host: `value`, valid once `landed`. A value in a
    reused buffer (`reused`) is overwritten by a later copy: clone what outlives it."""

    value: torch.Tensor
    done: torch.cuda.Event | None = None

    @property
    def reused(self) -> bool:
        return self.done is not None

    def landed(self) -> bool:
        """Whether the copy has arrived: asked of its event, never waited for."""
        return self.done is None or self.done.query()


class HostCopies:
    """IN_FLIGHT pinned host buffers, used in turn; the caller takes each copy before it
    makes IN_FLIGHT more."""

    def __init__(self):
        self.buffers: list[torch.Tensor | None] = [None] * IN_FLIGHT
        self.copies = 0

    def copy(self, tensor: torch.Tensor) -> HostCopy:
        if not tensor.is_cuda:
            return HostCopy(tensor)
        turn = self.copies % IN_FLIGHT
        self.copies += 1
        buffer = self.buffers[turn]
        if buffer is None or buffer.dtype != tensor.dtype or buffer.numel() < tensor.numel():
            buffer = torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=True)
            self.buffers[turn] = buffer
        host = buffer[: tensor.numel()].view(tensor.shape)
        host.copy_(tensor, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return HostCopy(host, done)
