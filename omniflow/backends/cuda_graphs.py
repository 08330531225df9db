"""CUDA graph capture shared by the backends that replay captured steps: the AR decode step
(`omniflow.backends.static_decode`), token2wav's window solve
(`omniflow.families.qwen2_5_omni.token2wav`) and the steps of decoders that carry their
state (`omniflow.backends.carried_state`).

`capture_graph` captures one function of static device buffers the way both need it: run
once eagerly first (Triton kernels compiled, cuBLAS and cuDNN set up, lazily loaded kernels
loaded), then captured on a side stream into a shared memory pool. A function already run
at another batch of the same shapes may skip its eager run: what compiles or loads once is
in place by then, and an eager run costs as much host time as the capture itself. Graphs
sharing a pool must never run at once; a backend's graphs replay one at a time on one
stream, and whatever a graph's output is stays referenced, so no later capture reuses its
memory. One capture runs at a time in a process, whichever stage's load it belongs to
(`omniflow.runtime.load_pools`: the stages of one executor load at once, each measured in its
own allocator pool, which a capture leaves for its graph pool).

`Graphs` keeps a set of such functions by key (a bucket), each with its static inputs and
output, and counts captures and replays. With `capture` False (CPU, or the eager "static"
mode) it runs each function eagerly on the same static buffers: the bookkeeping (buckets,
copying inputs in, slicing outputs out) is then the same code, testable without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from omniflow.runtime.load_pools import capturing, one_capture_at_a_time


def capture_graph(
    fn: Callable[[], object], pool, stream, warm_up: bool = True
) -> tuple[torch.cuda.CUDAGraph, object]:
    """`fn` (device work only: no host syncs, no data-dependent shapes) captured into a new
    graph in `pool` on `stream`, after one eager run on the current stream if `warm_up`.
    Returns the graph and what the captured call returned (its output buffers). Autograd
    is off: a capture with it on would keep every intermediate a backward pass could need
    in the graph's pool (the Qwen2.5-Omni audio tower's layer graphs held 11 GiB so)."""
    # One capture at a time: the stages of one executor load at once (load_pools.py).
    with one_capture_at_a_time(), torch.no_grad():
        if warm_up:
            fn()
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(stream.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream), capturing(graph):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                out = fn()
            finally:
                graph.capture_end()
        current.wait_stream(stream)
    return graph, out


class Graphs:
    """Functions of static input buffers, by key: captured as CUDA graphs when `capture`,
    else run eagerly on the same buffers. See the module docstring."""

    def __init__(self, device: str | torch.device, capture: bool):
        self.device = torch.device(device)
        self.capturing = capture
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.stream = torch.cuda.Stream(self.device) if capture else None
        self._entries: dict[Hashable, tuple] = {}
        self.captures = 0  # graphs captured (all when the backend loads)
        self.replays = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def keys(self) -> list[Hashable]:
        return list(self._entries)

    def add(
        self, key: Hashable, fn: Callable[..., torch.Tensor], inputs: dict, warm_up: bool = True
    ) -> None:
        """Register `fn(**inputs)` under `key`; `inputs` are the static buffers every call
        reads, which `run` fills. Captured now when capturing (after an eager run of it if
        `warm_up`: see `capture_graph`)."""
        if key in self._entries:
            raise ValueError(f"{key!r} is already registered")
        graph = out = None
        if self.capturing:
            graph, out = capture_graph(lambda: fn(**inputs), self.pool, self.stream, warm_up)
            self.captures += 1
        self._entries[key] = (fn, inputs, graph, out)

    def inputs(self, key: Hashable) -> dict:
        return self._entries[key][1]

    def run(self, key: Hashable, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """`fn` on `values`, copied into the leading rows of `key`'s static inputs (the rows
        past them keep what they held: rows of a batch are independent). Returns the output
        buffer itself, valid until the next `run` of any key."""
        fn, inputs, graph, out = self._entries[key]
        for name, value in values.items():
            inputs[name][: len(value)].copy_(value)
        if graph is None:
            return fn(**inputs)
        graph.replay()
        self.replays += 1
        return out

    def synchronize(self) -> None:
        if self.capturing:
            torch.cuda.synchronize(self.device)

    def clear(self) -> None:
        self._entries.clear()
