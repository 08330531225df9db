"""The reference interpreter: runs a plan's stages one after another, one request at a time,
whole values on every edge — no fusion, no placement, no channels, no processes.

It is the oracle: every pass and every runtime mode must produce what it produces.
"""

from __future__ import annotations

from collections import defaultdict

from omniflow.errors import OmniflowError
from omniflow.plan import Plan
from omniflow.runtime.backends import load_backend
from omniflow.runtime.edges import apply_maps, load_adapter
from omniflow.runtime.requests import RequestFailed, admit, describe, stage_params
from omniflow.runtime.stage import Call, InputStream, StageSpec
from omniflow.runtime.values import concat


class Interpreter:
    def __init__(self, plan: Plan, backends: str = "auto"):
        self.plan = plan
        self.specs = {s.name: StageSpec.from_channels(s, plan.channels) for s in plan.stages}
        self.backends = {
            name: load_backend(spec, "cpu", backends) for name, spec in self.specs.items()
        }
        self.adapters = {c.name: load_adapter(c, plan) for c in plan.channels}

    def run(self, inputs: dict, params: dict | None = None, request_id: str = "ref") -> dict:
        plan = self.plan
        request = admit(plan, inputs, params)
        values: dict[tuple[str, str], object] = {
            (name, "out"): v for name, v in request.inputs.items()
        }
        for stage in plan.stages:  # the plan lists stages in topological order
            spec = self.specs[stage.name]
            into = [c for c in plan.channels if c.dst == stage.name]
            streams = {c.dst_port: InputStream(c.type) for c in into}
            for c in into:
                streams[c.dst_port].push(self._through(c, values[c.src, c.src_port]), end=True)
            call = Call(request_id, stage_params(stage, request), streams)
            produced = defaultdict(list)
            backend = self.backends[stage.name]
            while not call.finished:
                if not backend.ready(call):
                    raise OmniflowError(
                        f"stage '{stage.name}' waits for input that will never come"
                    )
                backend.step([call])
                if call.error is not None:
                    backend.drop(call)
                    raise RequestFailed(f"stage '{stage.name}' failed: {describe(call.error)}")
                for port, value in call.emitted:
                    produced[port].append(value)
                call.emitted.clear()
            backend.drop(call)
            for port in spec.outputs:
                values[stage.name, port] = (
                    concat(spec.outputs[port].type, produced[port]) if produced[port] else None
                )
        return {
            c.dst: self._through(c, values[c.src, c.src_port])
            for c in plan.channels
            if c.dst in {o.name for o in plan.outputs}
        }

    def _through(self, channel, value):
        adapter = self.adapters[channel.name]
        if value is not None and adapter is not None:
            value = adapter(value)
        return apply_maps(channel, apply_maps(channel, value, "src"), "dst")
