"""Keeping the Hugging Face libraries quiet while omniflow loads or builds models.

Model backends and the tiny-checkpoint builders both load through transformers and
diffusers, which report every load on their own; `quiet()` is the one switch for that. A
download is news: huggingface_hub's progress bars stay as they were.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence transformers' and diffusers' logging and progress bars for a block, leaving
    huggingface_hub's download bars as they were.

    Loading a stage's model or building a tiny checkpoint is not news: without this every
    load prints weight-loading bars, and Qwen2.5-Omni's talker config warns on every
    construction that it names thinker-vocabulary ids (its text and vision tokens) outside
    its own codec vocabulary, which the real config does too. A first download of real
    weights (gigabytes, minutes) is: transformers' switch turns the hub's bars off too, so
    they are turned back on.
    """
    import huggingface_hub.utils as hub_utils
    import transformers.utils.logging as transformers_logging

    libs = [transformers_logging]
    # Only diffusers pipelines need diffusers, and their code has imported it by now; for
    # everything else importing it here would add its import to a stage's load.
    if "diffusers" in sys.modules:
        import diffusers.utils.logging as diffusers_logging

        libs.append(diffusers_logging)
    saved = [(lib, lib.get_verbosity(), lib.is_progress_bar_enabled()) for lib in libs]
    hub_bars = not hub_utils.are_progress_bars_disabled()
    for lib, _, _ in saved:
        lib.set_verbosity_error()
        lib.disable_progress_bar()
    if hub_bars:
        hub_utils.enable_progress_bars()
    try:
        yield
    finally:
        for lib, verbosity, bars in saved:
            lib.set_verbosity(verbosity)
            if bars:
                lib.enable_progress_bar()
        if not hub_bars:  # transformers' switch turns the hub's on with its own
            hub_utils.disable_progress_bars()
