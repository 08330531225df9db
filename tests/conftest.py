"""Shared test setup: the repository's root importable after installed packages, no network
for model hubs, and GPU tests skipped without a GPU.

The tests import one another's helpers as `tests.…`, so the root is on sys.path, but last:
its top-level `dsl/` and `kernels/` (installed as `omniflow.dsl` and `omniflow.kernels`)
would shadow the packages of those names ahead of site-packages (transformers imports
PyPI's `kernels`). `make test` runs `python -P -m pytest`, which leaves it off; a plain
`python -m pytest` puts it first, and it moves here, before any test imports transformers.
"""

import os
import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[1])
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != ROOT] + [ROOT]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
