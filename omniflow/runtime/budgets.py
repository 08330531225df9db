"""Placement budgets inside a shared executor: each stage's load is held to its own budget.

The stages of one GPU share one process, so they share its CUDA context and torch's caching
allocator: a per-process cap (`torch.cuda.set_per_process_memory_fraction`) would bound them
together, not each. Instead a stage's load is measured, and a stage whose load took more than
its budget stops the executor's start with an error naming it. How it is measured depends on
how the executor loads its stages (loading.py):

- one after another (`load_within_budget`): what torch's allocator holds on the stage's GPU
  after the stage loaded (weights, caches sized at load, captured graphs' pools) less what it
  held before -- its own, since nothing else loads meanwhile;
- at once, a thread each (`load_in_own_pool`): the stage loads in an allocator pool of its
  own (load_pools.py: every allocation its thread makes goes there, a CUDA graph it captures
  to the graph pool it notes), and its load is what those pools hold afterwards, which no
  other stage's load touches.

Off CUDA (a CPU executor, or a GPU plan run where its GPUs are absent) there is no allocator
to measure and the check passes. A budget of 0 is one placement planned nothing for (a
python stage without `memory=`): it is not checked.

Once its stages loaded, an executor process says what it holds on each of its GPUs
(`memory_after_load`: `control.Memory`, the `... torch reserved X of the Y planned` line of
the server log), so that a plan's budgets can be checked against what loading took; off
CUDA it says nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from omniflow.devices import human_bytes, local_name
from omniflow.errors import OmniflowError
from omniflow.plan import Program, StagePlan
from omniflow.runtime import control
from omniflow.runtime.load_pools import LoadPool
from omniflow.runtime.streams import cuda_here

Loaded = TypeVar("Loaded")


class OverBudget(OmniflowError):
    """A stage took more GPU memory to load than its placement budget."""


def allocated(device: str) -> int:
    """Bytes torch's caching allocator holds in tensors on `device` (0 off CUDA)."""
    return torch.cuda.memory_allocated(local_name(device)) if cuda_here(device) else 0


def gpu_memory(device: str) -> tuple[int, int, int] | None:
    """What `device` holds now: the bytes torch's allocator reserved there in this process,
    those of them in tensors, and the device's bytes in use (every process's, CUDA contexts
    included); None off CUDA."""
    if not cuda_here(device):
        return None
    name = local_name(device)
    free, total = torch.cuda.mem_get_info(name)
    return torch.cuda.memory_reserved(name), torch.cuda.memory_allocated(name), total - free


def memory_after_load(program: Program) -> list[control.Memory]:
    """What `program`'s executor holds on each of its GPUs once its stages loaded, beside
    what the plan gave its stages there (empty off CUDA)."""
    reports = []
    for device in dict.fromkeys(program.devices):
        held = gpu_memory(device)
        if held is not None:
            planned = sum(s.budget_bytes for s in program.stages if device in s.devices)
            reports.append(control.Memory(program.name, device, planned, *held))
    return reports


def check_budget(stage: StagePlan, device: str, took: int) -> None:
    """Raise OverBudget if `took` bytes exceed the stage's budget."""
    if stage.budget_bytes and took > stage.budget_bytes:
        raise OverBudget(
            f"stage '{stage.name}' took {human_bytes(took)} of {device} to load, over its "
            f"budget of {human_bytes(stage.budget_bytes)} (the compiler estimated it needs "
            f"{human_bytes(stage.need_bytes)}); lower its max_batch or max_len, or give it "
            "an explicit memory=... budget"
        )


def load_within_budget(stage: StagePlan, device: str, load: Callable[[], Loaded]) -> Loaded:
    """`load()`, measured on `device` and held to the stage's budget."""
    before = allocated(device)
    loaded = load()
    check_budget(stage, device, allocated(device) - before)
    return loaded


def load_in_own_pool(
    stage: StagePlan,
    device: str,
    load: Callable[[], Loaded],
    discard: Callable[[Loaded], None],
) -> tuple[Loaded, LoadPool | None]:
    """`load()` in an allocator pool of its own on `device`, measured as what that pool and
    its captures' graph pools hold, and held to the stage's budget (over it, what loaded is
    `discard`ed first); other stages may load at the same time on other threads. Returns
    what loaded and its pool, which holds its memory (None off CUDA: nothing is measured)."""
    if not cuda_here(device):
        return load(), None
    pool = LoadPool(device)
    with pool.entered():
        loaded = load()
    try:
        check_budget(stage, device, pool.held())
    except OverBudget:
        discard(loaded)
        raise
    return loaded, pool
