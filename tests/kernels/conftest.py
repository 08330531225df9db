"""Triton kernels run on the CPU in Triton's interpreter, in a fresh Python.

`TRITON_INTERPRET=1` must be set before `triton` is imported: `triton.jit` picks an
interpreted or a compiled function when it decorates, and Triton decorates its own library
(`tl.rand`, `tl.cumsum`, ...) on import. This process may already hold compiled kernels (the
diffusion backend imports `cfg_euler`, and GPU tests need them compiled), so
`interpret(job, *args)` calls `job`, a module-level function of a test file, in a
subprocess with the variable set (`python -P` on this process's sys.path: see
tests/conftest.py), and returns its result. Arguments and results travel by
`torch.save` (tensors, numbers, None, and lists, tuples and dicts of them). Each call costs
a Python start (about a second): run all of a file's kernel cases in one job, unless that
job takes a large share of the 120 s limit (over ~20 s on an idle 2-core machine: a loaded
one runs it two or three times slower); then split it, a job per test.

A file's GPU tests take the operands its interpreted test takes (its `cases()`, or the same
makers at other sizes, which a CPU test here also runs), so a change to a kernel's operands
or signature fails on the CPU first; only the compiled kernels need the GPU.
"""

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

_RUNNER = """
import importlib.util, json, sys, torch
path, name, args, result, search = sys.argv[1:]
sys.path[:] = json.loads(search)  # the test process's: the files import `tests.`
spec = importlib.util.spec_from_file_location("interpreted_job", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
torch.save(getattr(module, name)(*torch.load(args)), result)
"""


@pytest.fixture(scope="session")
def interpret(tmp_path_factory):
    pytest.importorskip("triton")

    def run(job, *args):
        folder = tmp_path_factory.mktemp(job.__name__)
        torch.save(args, folder / "args.pt")
        command = [sys.executable, "-P", "-c", _RUNNER, inspect.getfile(job), job.__name__]
        done = subprocess.run(
            [*command, str(folder / "args.pt"), str(folder / "result.pt"), json.dumps(sys.path)],
            env={**os.environ, "TRITON_INTERPRET": "1"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode:
            pytest.fail(f"{job.__name__} under TRITON_INTERPRET=1 failed:\n{done.stderr}")
        return torch.load(folder / "result.pt")

    return run


@pytest.fixture
def on_cuda():
    """For a GPU test (skipped without CUDA): a case's operands with its tensors on CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return lambda args: [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
