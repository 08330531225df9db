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
job takes a large share of the 240 s limit (over ~20 s on an idle 2-core machine: a loaded
one, such as `make test`'s two workers make it, runs it two or three times slower); then
split it, a job per test.

A file of several jobs starts them together as it begins, `interpret_ahead(request,
{test: [(job, *args), ...]})` in a module fixture: those of the tests this session runs, a
job that several tests share once. They run side by side, `WORKERS` at a time (each an
interpreter thread, under its own 240 s from its own start), while this process runs the
tests; a test's `interpret(job, *args)` then takes its started job's result.

A file's GPU tests take the operands its interpreted test takes (its `cases()`, or the same
makers at other sizes, which a CPU test here also runs), so a change to a kernel's operands
or signature fails on the CPU first; only the compiled kernels need the GPU.
"""

import importlib.util
import inspect
import io
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor

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


# Jobs at once: each is one interpreter thread (the jobs set torch's threads to 1), so a
# 2-core machine runs two side by side in about the time of one.
WORKERS = max(1, min(4, os.cpu_count() or 1))
# The longest job took 57 s under `make test`'s two workers on the 2-core machine; within
# pytest-timeout's 300 s a test.
TIMEOUT_S = 240


class Interpret:
    """`interpret(job, *args)`: `job(*args)` under TRITON_INTERPRET=1 in a fresh Python, or
    the result of the same job started by `ahead`."""

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self._pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="interpret")
        self._started: dict[tuple, list[Future]] = {}
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def __call__(self, job, *args):
        waiting = self._started.get(self._key(job, args))
        started = waiting.pop(0) if waiting else self._start(job, args)
        folder, returncode, stderr = started.result()
        if returncode is None:
            pytest.fail(f"{job.__name__} under TRITON_INTERPRET=1 ran over {TIMEOUT_S} s")
        if returncode:
            pytest.fail(f"{job.__name__} under TRITON_INTERPRET=1 failed:\n{stderr}")
        return torch.load(folder / "result.pt")

    def ahead(self, request, jobs: dict) -> None:
        """Start the jobs of those tests of `request`'s module that this session runs, in
        order, each distinct job once: `jobs` maps a test (its function) to the
        `(job, *args)` tuples it (or a fixture it takes) interprets."""
        chosen = {
            item.originalname
            for item in request.session.items
            if getattr(item, "module", None) is request.module
        }
        wanted = {}
        for test, needs in jobs.items():
            for job, *args in needs if test.__name__ in chosen else ():
                wanted.setdefault(self._key(job, tuple(args)), (job, tuple(args)))
        for key, (job, args) in wanted.items():
            self._started.setdefault(key, []).append(self._start(job, args))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for proc in self._running:
                proc.kill()

    @staticmethod
    def _key(job, args) -> tuple:
        buffer = io.BytesIO()
        torch.save(args, buffer)
        return inspect.getfile(job), job.__name__, buffer.getvalue()

    def _start(self, job, args) -> Future:
        folder = self._tmp.mktemp(job.__name__)
        torch.save(args, folder / "args.pt")
        command = [sys.executable, "-P", "-c", _RUNNER, inspect.getfile(job), job.__name__]
        command += [str(folder / "args.pt"), str(folder / "result.pt"), json.dumps(sys.path)]
        return self._pool.submit(self._run, command, folder)

    def _run(self, command: list[str], folder) -> tuple:
        with self._lock:
            proc = subprocess.Popen(
                command,
                env={**os.environ, "TRITON_INTERPRET": "1"},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            self._running.add(proc)
        try:
            _, stderr = proc.communicate(timeout=TIMEOUT_S)
            return folder, proc.returncode, stderr
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return folder, None, ""
        finally:
            with self._lock:
                self._running.discard(proc)


@pytest.fixture(scope="session")
def interpret(tmp_path_factory):
    pytest.importorskip("triton")
    interpreter = Interpret(tmp_path_factory)
    yield interpreter
    interpreter.close()


@pytest.fixture(scope="session")
def interpret_ahead(request):
    """`interpret_ahead(request, jobs)`: `interpret.ahead` where Triton is installed;
    without it nothing (the tests that interpret skip, the file's others run)."""
    if importlib.util.find_spec("triton") is None:
        return lambda request, jobs: None
    return request.getfixturevalue("interpret").ahead


@pytest.fixture
def on_cuda():
    """For a GPU test (skipped without CUDA): a case's operands with its tensors on CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return lambda args: [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
