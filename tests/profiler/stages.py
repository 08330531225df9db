"""Stages the profiler's tests run: one that launches a CUDA kernel per chunk; an edge
adapter."""

import torch


def double_on_gpu(call):
    """Streams `in` to `out` doubled, each chunk through a kernel on the stage's GPU."""
    while (chunk := (yield from call.read("in"))) is not None:
        doubled = torch.as_tensor(chunk, device="cuda") * 2
        call.emit("out", doubled.cpu())


def negate(source):
    """An edge adapter (a factory given the producing StagePlan): each chunk negated."""
    return lambda value: -value
