"""The GPU tests' set-up on the CPU: a plan compiled for GPUs, its stages' backends built
here as its executors would build them there.

A GPU test's wiring (the ports its plan gives a stage, the stage's constructor, its model
family's loader) breaks on any machine; only its kernels need the GPU. So each GPU test's
set-up is a function its CPU twin calls too (docs/testing.md), and where that set-up is a
plan, `stages_on_cpu` loads it: every stage through the backend its executor would choose,
on the CPU. The one setting a CPU cannot take is `decode="graphs"` (CUDA graphs): those
stages decode on the same static buffers, run eagerly ("static")."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

from omniflow.backends.registry import load_backend
from omniflow.plan import Plan
from omniflow.runtime.stage import Backend, StageSpec


@contextmanager
def stages_on_cpu(plan: Plan, backends: str = "auto") -> Iterator[dict[str, Backend]]:
    """Every stage of `plan` loaded on the CPU, by name (`backends` as `Engine` takes it);
    closed on exit."""
    loaded: dict[str, Backend] = {}
    try:
        for stage in plan.stages:
            if "decode" in stage.settings:
                decode = cpu_decode(stage.settings["decode"])
                stage = dataclasses.replace(stage, settings={**stage.settings, "decode": decode})
            spec = StageSpec.from_channels(stage, plan.channels)
            loaded[stage.name] = load_backend(spec, "cpu", backends)
        yield loaded
    finally:
        for backend in loaded.values():
            backend.close()


def cpu_decode(decode: str) -> str:
    """The decode setting a stage takes on the CPU for `decode`: "graphs" runs "static"."""
    return "static" if decode == "graphs" else decode


def stage_spec(plan: Plan, name: str, **settings) -> StageSpec:
    """Stage `name` of `plan` as a backend takes it, `settings` over its own."""
    stage = plan.stage(name)
    stage = dataclasses.replace(stage, settings={**stage.settings, **settings})
    return StageSpec.from_channels(stage, plan.channels)
