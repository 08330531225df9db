"""Naming the host syncs a stage's step makes: `OMNIFLOW_SYNC_DEBUG=warn` or `error`.

On one GPU every stage of a plan runs in one process, one thread stepping them all, so a
host sync in one stage's step (`.item()`, `.tolist()` or `.cpu()` of a CUDA tensor, `if t:`,
`nonzero`, a mask index, a blocking copy to or from the device) stalls every other stage
(docs/architecture.md, "One GPU, one process"). With the variable set, each stage's step runs
under torch's sync debug mode (`torch.cuda.set_sync_debug_mode`; process-wide, so another
thread's sync meanwhile is named too): "warn" prints each place a step syncs, once, with the
Python stack that reached it; "error" makes the sync raise, which fails that step's requests
(their error names the operation; the executor's log has the stack): for tests. Only
`Backend.step` runs under it: loads, captures, warm-ups, profiles and the loop's own work
(`ready`, routing, rings) do not. A process that never used CUDA has nothing to sync on, and
is left alone (torch's call would start CUDA there, or fail on a CPU-only build).
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings

import torch

from omniflow.errors import OmniflowError

ENV = "OMNIFLOW_SYNC_DEBUG"
MODES = ("warn", "error")
# What torch's warning and error say (c10/cuda/CUDAFunctions.h, warn_or_error_on_sync).
TORCH_MESSAGE = "called a synchronizing CUDA operation"


def mode_from_env() -> str | None:
    """The mode `OMNIFLOW_SYNC_DEBUG` asks for: "warn", "error", or None (unset, empty)."""
    mode = os.environ.get(ENV, "").strip().lower()
    if not mode:
        return None
    if mode not in MODES:
        raise OmniflowError(f"{ENV}={mode!r}: expected one of {', '.join(MODES)} (or unset)")
    return mode


class StepSyncs:
    """A context a stage's step runs in: torch's sync debug mode `mode` (None: off) while it
    runs, where this process uses CUDA; the mode before it restored after. Torch's mode
    names its copies' and streams' waits, not an event's: `HostCopy.wait` on a read-back
    still on its way is named the same way here (`name_wait`)."""

    def __init__(self, mode: str | None):
        self.mode = mode
        self.before: int | None = None
        if mode == "warn":
            _show_stacks()

    @classmethod
    def from_env(cls) -> StepSyncs:
        return cls(mode_from_env())

    def __enter__(self) -> StepSyncs:
        global _stepping
        if self.mode is not None and torch.cuda.is_initialized():
            self.before = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(self.mode)
            _stepping = self.mode
        return self

    def __exit__(self, *exc) -> None:
        global _stepping
        if self.before is not None:
            torch.cuda.set_sync_debug_mode(self.before)
            _stepping = {1: "warn", 2: "error"}.get(self.before)
            self.before = None


# The mode of the step running now (None: no step, or not checked).
_stepping: str | None = None


def name_wait(what: str) -> None:
    """Name a host wait torch's mode does not see (`what` it waits for), as torch names its
    own: raise under "error", warn under "warn"; nothing outside a checked step."""
    if _stepping == "error":
        raise RuntimeError(f"{TORCH_MESSAGE}: {what}")
    if _stepping == "warn":
        warnings.warn(f"{TORCH_MESSAGE}: {what}", stacklevel=3)


def _show_stacks() -> None:
    """Print torch's sync warnings with the stack that made them (a warning alone names
    only the line of the operation); other warnings as before. Installed once."""
    shown = warnings.showwarning
    if getattr(shown, "with_sync_stacks", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if TORCH_MESSAGE not in str(message):
            return shown(message, category, filename, lineno, file, line)
        frames = [
            f
            for f in traceback.extract_stack()[:-1]
            if not f.filename.endswith(("warnings.py", "sync_debug.py"))
        ]
        stack = "".join(traceback.format_list(frames))
        print(f"host sync in a stage's step ({message}):\n{stack}", file=file or sys.stderr)

    show.with_sync_stacks = True
    warnings.showwarning = show
