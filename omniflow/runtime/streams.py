"""A stage's CUDA stream in its executor, and how the stages of one process hand chunks to
each other on the GPU.

The compiler puts the stages of one GPU in one executor and gives each a stream priority
(`Program.stream_priorities`: lower runs first, the stage nearest the listener lowest).
Where that GPU is here, each stage gets a CUDA stream of its own at its priority, and all of
its GPU work runs on it: its load, its steps, the routing of what a step produced (adapters,
map chains, copies into rings) and the reading of its inbound rings. So one stage's kernels
overlap another's, and the GPU's scheduler favours the stage nearest the listener.

A chunk one stage hands another in the same process (a `local` channel: a reference) is
ordered on the GPU alone: the producer records an event on its stream after the work that
made the chunk, and the consumer's stream waits for that event before its next work
(`hand_off`, `active`). The chunk's tensors are marked as in use on the consumer's stream
(`record_stream`), so the caching allocator does not give their memory back to the
producer's stream while the consumer may still read it. Nothing is copied and the host
never waits.

A step that breaks its GPU's CUDA context (a device-side assert, an illegal address: every
later call on that GPU fails) has broken it for every stage of the process: the stage's
stream says so after a failed step (`check_context`), and the executor ends, so that the
engine fails the requests in flight through any of its stages and restarts it with all of
them. A failure that leaves the context usable (out of memory, a bad input) fails only the
requests of the step that raised.

Everywhere else -- a CPU executor, the frontend, a GPU plan run where its GPUs are absent
(stand-in stages on a CPU machine, as the tests run the examples) -- a stage's stream is
`PROGRAM_ORDER`: its work runs on the current stream, in the order the loop issues it, and a
hand-off is the reference alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from omniflow.devices import local_name
from omniflow.errors import OmniflowError
from omniflow.plan import Program


def cuda_here(device: str) -> bool:
    """Whether `device` names a CUDA device this process can use."""
    name = local_name(device)
    if not name.startswith("cuda") or not torch.cuda.is_available():
        return False
    return (torch.device(name).index or 0) < torch.cuda.device_count()


class GpuContextLost(OmniflowError):
    """A stage's step left its GPU's CUDA context unusable: the executor must restart."""


class StageStream:
    """Program order: the stage's work runs on the current stream; nothing to order."""

    def check_context(self, stage: str) -> None:
        """After `stage`'s step raised: GpuContextLost if the step broke its GPU's context
        (off GPUs there is none to break)."""

    def active(self) -> contextlib.AbstractContextManager:
        """While entered, the stage's work runs on its stream, after the chunks handed to it."""
        return contextlib.nullcontext()

    def hand_off(self, value, consumer: StageStream) -> None:
        """`value`, made by this stage's work so far, goes to `consumer`'s stage."""


PROGRAM_ORDER = StageStream()


class CudaStageStream(StageStream):
    """A CUDA stream of the stage's own."""

    def __init__(self, device: str, priority: int):
        self.device = device
        self.stream = torch.cuda.Stream(device=local_name(device), priority=priority)
        # Per consumer: the event this stream records after the work of its hand-offs to it.
        self._recorded: dict[int, torch.cuda.Event] = {}
        # Per producer: its event this stream waits for before its next work (one per
        # producer: the latest record covers every chunk handed over before it).
        self._waits: dict[int, torch.cuda.Event] = {}

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        for event in self._waits.values():
            self.stream.wait_event(event)
        self._waits.clear()
        with torch.cuda.stream(self.stream):
            yield

    def check_context(self, stage: str) -> None:
        try:
            self.stream.synchronize()  # a broken context fails every call; only on a failure
        except RuntimeError as err:  # torch's AcceleratorError is one
            cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise GpuContextLost(
                f"stage '{stage}' broke the CUDA context of {self.device} ({cause}); the "
                "executor restarts with all its stages"
            ) from err

    def hand_off(self, value, consumer: StageStream) -> None:
        tensors = _cuda_tensors(value)
        if not tensors or not isinstance(consumer, CudaStageStream) or consumer is self:
            return  # nothing on the GPU to order (text, an end), or nothing to order it for
        for tensor in tensors:
            tensor.record_stream(consumer.stream)
        event = self._recorded.get(id(consumer))
        if event is None:
            event = self._recorded[id(consumer)] = torch.cuda.Event()
        event.record(self.stream)
        consumer._waits[id(self)] = event


def _cuda_tensors(value) -> list[torch.Tensor]:
    """The CUDA tensors a port value holds: itself, or a media list's items."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return [t for t in items if isinstance(t, torch.Tensor) and t.is_cuda]


def settle_loads(streams: dict[str, StageStream]) -> None:
    """Once every stage has loaded, each on its own stream: wait for the loads' GPU work, so
    that what one stage's load made and another reads (a module a family caches for both)
    is there whichever stream reads it. Once per start, never on a hot path."""
    for stream in streams.values():
        if isinstance(stream, CudaStageStream):
            stream.stream.synchronize()


def stage_streams(program: Program) -> dict[str, StageStream]:
    """Each stage's stream: a CUDA stream of its own at the plan's priority where the program
    gives priorities and the stage's GPU is here, else program order."""
    streams: dict[str, StageStream] = {}
    for stage in program.stages:
        priority = program.stream_priorities.get(stage.name)
        here = priority is not None and bool(stage.devices) and cuda_here(stage.devices[0])
        streams[stage.name] = CudaStageStream(stage.devices[0], priority) if here else PROGRAM_ORDER
    return streams
