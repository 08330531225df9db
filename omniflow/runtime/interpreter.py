"""The reference interpreter: runs a plan's stages one after another, one request at a time,
each stage to its end before the next begins -- no fusion, no placement, no rings, no
processes.

It is the oracle: every pass and every runtime mode must produce what it produces. Values
cross edges through the same code the program loops use (edges.py: chunked by the edge's
schedule, adapted and mapped where they leave and where they arrive), so the interpreter and
the runtime differ only in when things run, never in what an edge does to a value.
"""

from __future__ import annotations

from collections import defaultdict

from omniflow.backends.registry import load_backend
from omniflow.errors import OmniflowError
from omniflow.plan import ChannelPlan, Plan
from omniflow.runtime.edges import StreamWriter, arriving, leaving
from omniflow.runtime.port_values import concat
from omniflow.runtime.requests import RequestFailed, admit, describe, stage_params
from omniflow.runtime.stage import Call, InputStream, StageSpec
from omniflow.runtime.sync_debug import StepSyncs

Chunks = list[tuple[object, bool]]  # (value or None, end) as they reach the consumer


class Interpreter:
    def __init__(self, plan: Plan, backends: str = "auto"):
        self.plan = plan
        self.specs = {s.name: StageSpec.from_channels(s, plan.channels) for s in plan.stages}
        self.backends = {
            name: load_backend(spec, "cpu", backends) for name, spec in self.specs.items()
        }
        stages = {s.name: s for s in plan.stages}
        self.leave = {c.name: leaving(c, stages.get(c.src)) for c in plan.channels}
        self.arrive = {c.name: arriving(c) for c in plan.channels}
        self.syncs = StepSyncs.from_env()  # OMNIFLOW_SYNC_DEBUG: a step's host syncs named

    def run(self, inputs: dict, params: dict | None = None, request_id: str = "ref") -> dict:
        plan = self.plan
        request = admit(plan, inputs, params)
        arrived: dict[str, Chunks] = {}
        for name, value in request.inputs.items():
            self._flow(request_id, name, "out", [value], arrived)
        for name in request.absent:  # optional inputs left out: their edges end empty
            self._flow(request_id, name, "out", [], arrived)
        for stage in plan.stages:  # the plan lists stages in topological order
            into = [c for c in plan.channels if c.dst == stage.name]
            streams = {c.dst_port: InputStream(c.type) for c in into}
            for c in into:
                for value, end in arrived[c.name]:
                    streams[c.dst_port].push(value, end)
            call = Call(request_id, stage_params(stage, request), streams)
            produced = defaultdict(list)
            backend = self.backends[stage.name]
            while not call.finished:
                if not backend.ready(call):
                    if backend.in_flight():  # its device work is on its way (a GPU's)
                        continue
                    raise OmniflowError(
                        f"stage '{stage.name}' waits for input that will never come"
                    )
                with self.syncs:
                    backend.step([call])
                if call.error is not None:
                    backend.drop(call)
                    raise RequestFailed(f"stage '{stage.name}' failed: {describe(call.error)}")
                for port, value in call.emitted:
                    produced[port].append(value)
                call.emitted.clear()
            backend.drop(call)
            for port in self.specs[stage.name].outputs:
                self._flow(request_id, stage.name, port, produced[port], arrived)
        outputs = {}
        for c in plan.channels:
            if c.dst in {o.name for o in plan.outputs}:
                values = [v for v, _ in arrived[c.name] if v is not None]
                if values:
                    outputs[c.dst] = concat(c.type, values)
        return outputs

    def _flow(self, request_id: str, src: str, port: str, values: list, arrived: dict) -> None:
        """Send a producer port's values down each of its edges, as a program loop would."""
        for channel in (c for c in self.plan.channels if (c.src, c.src_port) == (src, port)):
            arrived[channel.name] = self._through(channel, request_id, values)

    def _through(self, channel: ChannelPlan, request_id: str, values: list) -> Chunks:
        chunks: Chunks = []
        arrive = self.arrive[channel.name]
        writer = StreamWriter(
            channel,
            lambda _rid, _index, value, end, _ending: chunks.append((arrive(value), end)),
            self.leave[channel.name],
        )
        for value in values:
            writer.write(request_id, value)
        writer.end(request_id)
        return chunks
