"""The garbage collector in a long-running process: what start-up made (imported modules,
the models' Python objects, tokenizers, the plan) lives as long as the process, so once
start-up is done it is frozen out of every later collection (`freeze_startup_heap`).
Otherwise each full collection walks all of it while every thread of the process waits:
an API process serving Qwen3-TTS (tiny, the 2-core machine) paused 164-295 ms in each full
collection under bursts of 16 streams, where every stream's chunks and every request's
admission wait on it (docs/benchmarks-log.md, "The API process's garbage collector: ...")."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect what start-up left behind, then move every object still alive into the
    collector's permanent generation, which no later collection walks (they still collect
    what the process makes from now on)."""
    gc.collect()
    gc.freeze()
