"""Placement budgets inside a shared executor: each stage's load is held to its own budget.

The stages of one GPU share one process, so they share its CUDA context and torch's caching
allocator: a per-process cap (`torch.cuda.set_per_process_memory_fraction`) would bound them
together, not each. Instead a stage's load is measured: what torch's allocator holds on its
GPU after the stage loaded (weights, caches sized at load, captured graphs' pools) less what
it held before, and a stage whose load took more than its budget stops the executor's start
with an error naming it. Stages load one after another, so each measure is its own.

Off CUDA (a CPU executor, or a GPU plan run where its GPUs are absent) there is no allocator
to measure and the check passes. A budget of 0 is one placement planned nothing for (a
python stage without `memory=`): it is not checked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from omniflow.devices import human_bytes, local_name
from omniflow.errors import OmniflowError
from omniflow.plan import StagePlan
from omniflow.runtime.streams import cuda_here

Loaded = TypeVar("Loaded")


class OverBudget(OmniflowError):
    """A stage took more GPU memory to load than its placement budget."""


def allocated(device: str) -> int:
    """Bytes torch's caching allocator holds in tensors on `device` (0 off CUDA)."""
    return torch.cuda.memory_allocated(local_name(device)) if cuda_here(device) else 0


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
