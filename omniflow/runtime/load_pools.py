"""A stage's load in an allocator pool of its own, so that stages loading at once in one
executor are each measured alone (budgets.py), and CUDA-graph captures one at a time.

While a stage loads on its thread, every allocation that thread makes on the stage's GPU
goes to the stage's `LoadPool` (a `torch.cuda.MemPool`, entered for the current thread
only); what the stage allocates later, on the executor's thread, goes to the default pool as
it always did. The pool outlives the load: it holds the stage's weights and caches, and the
memory its load freed stays reserved in it, for no other stage. Only the loading thread's
allocations are routed: a thread the load starts itself (a library's loader threads)
allocates in the default pool, unmeasured.

A CUDA graph captured during a load (`capture_graph`, backends/cuda_graphs.py) allocates in
its own graph pool, never in the stage's pool: torch's allocator gives an allocation to the
first pool whose filter takes it, and a thread's pool, entered first, would otherwise take
the capture's allocations too, where the stage's later eager allocations could reuse memory
a replay still writes. So a capture leaves the load's pool while it runs (`capturing`) and
notes its graph pool, which the load's measure then counts.

Captures run one at a time per process, whichever thread's (`one_capture_at_a_time`):
torch does not promise that captures in several threads at once are safe (even each with
`capture_error_mode="thread_local"` and its own pool and stream), and a capture's warm-up
run compiles Triton kernels. The other stages' weights keep loading meanwhile. A device-wide
`torch.cuda.synchronize` in another thread breaks a capture in flight on that GPU whatever
its mode (and fails itself), so while stages load at once such a call, and an `empty_cache`
(which frees device memory), waits for the capture to end (`between_captures`). A sync on
one stream (`.item()`, a copy to the host) should not touch a capture on another thread's
stream, torch's streams being non-blocking, and runs as it is (tests/runtime/test_loading.py's
GPU test copies weights beside a capture).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

from omniflow.devices import local_name

# One CUDA-graph capture (its warm-up run and the capture) at a time in this process, and no
# device-wide synchronize during one (`between_captures`). Reentrant: a capture's warm-up
# run may synchronize.
_CAPTURING = threading.RLock()
# The stage load running on this thread, if any: its `LoadPool`.
_loading = threading.local()


class LoadPool:
    """The allocator pool one stage loads into on its GPU, and the graph pools its captures
    made; `held()` is what they hold in tensors."""

    def __init__(self, device: str):
        self.index = torch.device(local_name(device)).index or 0
        with torch.cuda.device(self.index):
            self.pool = torch.cuda.MemPool()
        self.graph_pools: set[tuple[int, int]] = set()

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """While entered, this thread's allocations on the pool's GPU go to the pool."""
        previous = getattr(_loading, "pool", None)
        _loading.pool = self
        self._route()
        try:
            yield
        finally:
            self._unroute()
            _loading.pool = previous

    def _route(self) -> None:
        torch._C._cuda_beginAllocateCurrentThreadToPool(self.index, self.pool.id)

    def _unroute(self) -> None:  # as torch.cuda.use_mem_pool leaves a pool
        torch._C._cuda_endAllocateToPool(self.index, self.pool.id)
        torch._C._cuda_releasePool(self.index, self.pool.id)

    def held(self) -> int:
        """Bytes held in tensors by the stage's pool and its captures' graph pools."""
        return sum(_allocated_in(self.index, pool) for pool in {self.pool.id, *self.graph_pools})


def _allocated_in(index: int, pool: tuple[int, int]) -> int:
    """Bytes in tensors in allocator pool `pool` on GPU `index` (as memory_allocated counts)."""
    segments = torch.cuda.memory_snapshot(pool, include_traces=False)
    return sum(
        s["allocated_size"]
        for s in segments
        if s["device"] == index and tuple(s["segment_pool_id"]) == tuple(pool)
    )


@contextlib.contextmanager
def one_capture_at_a_time() -> Iterator[None]:
    """Around one capture's warm-up run and capture: the process's only capture meanwhile."""
    with _CAPTURING:
        yield


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph) -> Iterator[None]:
    """Around `graph`'s `capture_begin` .. `capture_end`: the capture allocates in its graph
    pool, not in the pool of a stage loading on this thread (see the module docstring),
    and that stage's load counts the graph pool."""
    load = getattr(_loading, "pool", None)
    if load is None:
        yield
        return
    load._unroute()
    try:
        yield
    finally:
        load._route()
    load.graph_pools.add(tuple(graph.pool()))


def between_captures(device_wide: Callable[..., None]) -> Callable[..., None]:
    """A device-wide call (`torch.cuda.synchronize`: a backend's wait for its load's GPU
    work; `torch.cuda.empty_cache`: giving back what a loader freed) that waits for any
    capture in flight to end first (see the module docstring); loading.py puts them in
    place while stages load at once."""

    def between(*args, **kwargs) -> None:
        with _CAPTURING:
            device_wide(*args, **kwargs)

    return between
