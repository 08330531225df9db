"""The `python` backend: any function can be a stage, referenced by dotted path.

Two forms:
- `f(batch: list[dict]) -> list[dict]` — called once per request (batched across requests)
  when all its inputs have ended; each dict maps input ports to whole values, each result
  maps output ports to values.
- a generator function `f(call)` — one generator per request, for streaming: it reads with
  `chunk = yield from call.read(port)` (None at end of stream), emits with
  `call.emit(port, value)`, and yields after each step so other requests get a turn.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

from omniflow.errors import OmniflowError
from omniflow.runtime.stage import Backend, Call, StageSpec, Wait


def import_function(dotted: str) -> Callable:
    """`pkg.mod.fn` or `pkg.mod:fn` -> the function."""
    module, sep, name = dotted.partition(":")
    if not sep:
        module, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise OmniflowError(f"cannot import '{dotted}': {err}") from err


class GeneratorBackend(Backend):
    """Runs one generator per request; the generator's `Wait`s tell when it is ready again."""

    def __init__(self, spec: StageSpec, device: str, fn: Callable):
        super().__init__(spec, device)
        self.fn = fn

    def ready(self, call: Call) -> bool:
        wait = call.state.get("wait")
        if wait is None:
            return True
        stream = call.inputs[wait.port]
        return stream.available() or stream.ended

    def step(self, calls: list[Call]) -> None:
        for call in calls:
            gen = call.state.get("gen")
            if gen is None:
                gen = call.state["gen"] = self.fn(call)
            try:
                out = next(gen)
            except StopIteration:
                call.finish()
                continue
            except Exception as err:  # a user function's failure belongs to its request alone
                call.fail(err)
                continue
            call.state["wait"] = out if isinstance(out, Wait) else None

    def drop(self, call: Call) -> None:
        gen = call.state.pop("gen", None)
        if gen is not None:
            gen.close()


class FunctionBackend(Backend):
    """Calls `f(batch) -> batch` with whole inputs once per request."""

    def __init__(self, spec: StageSpec, device: str, fn: Callable):
        super().__init__(spec, device)
        self.fn = fn

    def ready(self, call: Call) -> bool:
        return call.inputs_ended()

    def step(self, calls: list[Call]) -> None:
        batch = [{port: s.take() for port, s in call.inputs.items()} for call in calls]
        try:
            results = self._call(batch)
        except Exception:
            if len(calls) == 1:
                raise
            # Find whose input fails: one request at a time, so the others still succeed.
            for call, item in zip(calls, batch, strict=True):
                try:
                    self._finish(call, self._call([item])[0])
                except Exception as err:
                    call.fail(err)
            return
        for call, result in zip(calls, results, strict=True):
            self._finish(call, result)

    def _call(self, batch: list[dict]) -> list[dict]:
        results = self.fn(batch)
        if len(results) != len(batch):
            raise OmniflowError(
                f"stage function returned {len(results)} results for {len(batch)} requests"
            )
        return results

    @staticmethod
    def _finish(call: Call, result: dict) -> None:
        for port, value in result.items():
            call.emit(port, value)
        call.finish()


def function_backend(spec: StageSpec, device: str, fn: Callable) -> Backend:
    cls = GeneratorBackend if inspect.isgeneratorfunction(fn) else FunctionBackend
    return cls(spec, device, fn)


def python_backend(spec: StageSpec, device: str) -> Backend:
    return function_backend(spec, device, import_function(spec.plan.settings["fn"]))
