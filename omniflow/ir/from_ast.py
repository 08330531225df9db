"""The build phase: a parsed `ast.Pipeline` -> a checked IR `Graph`.

Every name is resolved and every edge's port types are checked here; each failure is a
GraphError that points at the offending source span and, where it helps, suggests a fix.
"""

from __future__ import annotations

import math
import re

from omniflow import families
from omniflow.dsl import ast
from omniflow.errors import GraphError, Span
from omniflow.hints import did_you_mean, one_of, suggest
from omniflow.ir.graph import (
    INPUT,
    OUTPUT,
    OUTPUT_PORT,
    Constraint,
    Edge,
    Graph,
    MapOp,
    Node,
)
from omniflow.ir.kinds import (
    EDGE_ATTRS,
    KINDS,
    NOT_YET_PARAMS,
    NOT_YET_PORTS,
    OUTPUT_ATTRS,
    SEED,
    SEED_PARAM,
    ParamSpec,
    number_text,
    parse_port_list,
)
from omniflow.ir.types import PORT_TYPES, TENSOR_TYPES
from omniflow.ir.values import AUTO, Param, Ref
from omniflow.kernels.pointwise_ops import OPS
from omniflow.sampling import KNOBS

_DEVICE = re.compile(r"^(cpu|cuda)(:\d+)?$")


def bounds_text(spec: ParamSpec) -> str:
    """`between 1 and 1048576`, `at least 0`: a number's bounds in words."""
    low, high = number_text(spec.low), number_text(spec.high)
    if spec.high == math.inf:
        return f"at least {low}"
    if spec.low == -math.inf:
        return f"at most {high}"
    return f"between {low} and {high}"


class _GraphBuilder:
    """One program's build: declarations first, then flows, then whole-graph checks."""

    def __init__(self, program: ast.Pipeline):
        self.program = program
        self.models = program.models
        self.graph = Graph(program.name)
        self.param_names = {p.name for p in program.params} | {SEED_PARAM}

    # --- values ----------------------------------------------------------------------
    def value(self, v, span: Span):
        if isinstance(v, Param):
            if v.name not in self.param_names:
                raise GraphError(
                    f"unknown parameter '${v.name}'",
                    v.span,
                    did_you_mean(v.name, self.param_names) or self._declare_hint(v.name),
                )
            return Param(v.name)  # resolved: the span stays with the source
        if isinstance(v, ast.Name):
            return Ref(v.dotted)
        if isinstance(v, ast.Auto):
            return AUTO
        if isinstance(v, list):
            return [self.value(x, span) for x in v]
        return v

    @staticmethod
    def _declare_hint(name: str) -> str:
        return f"declare it with `param {name} = ...`"

    def checked(self, attr: ast.Attr, specs: dict[str, ParamSpec], what: str):
        """The IR value of `attr`, checked against its spec in `specs`."""
        if attr.key in NOT_YET_PARAMS and attr.key not in specs:
            raise GraphError(NOT_YET_PARAMS[attr.key], attr.span, f"remove `{attr.key}=...`")
        if attr.key not in specs:
            raise _unknown(what, attr.key, attr.span, specs, "valid")
        spec = specs[attr.key]
        span = attr.value_span or attr.span
        value = True if attr.value is None and bool in spec.types else attr.value
        if value is None:
            raise GraphError(f"'{attr.key}' needs a value", attr.span, f"write `{attr.key}=...`")
        value = self.value(value, span)
        if isinstance(value, Param):
            declared = [p.default for p in self.program.params if p.name == value.name]
            default = declared[0] if declared else SEED.low  # the built-in seed
            self._check_type(attr.key, spec, self.value(default, span), span)
        else:
            self._check_type(attr.key, spec, value, span)
        return value

    @staticmethod
    def _check_type(key: str, spec: ParamSpec, value, span: Span) -> None:
        ok = isinstance(value, spec.types) and not (
            isinstance(value, bool) and bool not in spec.types
        )
        if not ok:
            names = " or ".join(
                t.__name__.replace("Ref", "name").replace("Auto", "auto") for t in spec.types
            )
            raise GraphError(f"'{key}' must be {names}, not {value!r}", span)
        if spec.choices and value not in spec.choices:
            raise GraphError(
                f"'{key}' must be one of {one_of(spec.choices)}, not {value!r}",
                span,
                did_you_mean(str(value), [str(c) for c in spec.choices]),
            )
        if isinstance(value, (int, float)) and not spec.low <= value <= spec.high:
            raise GraphError(f"'{key}' must be {bounds_text(spec)}, not {value!r}", span)
        if spec.knob and (problem := KNOBS[spec.knob].problem(value)):
            raise GraphError(f"'{key}' is out of its domain: {problem}", span)

    # --- declarations --------------------------------------------------------------------
    def declarations(self) -> None:
        if len(self.models) > 1:
            raise GraphError(
                "the default model is declared twice",
                self.models[1].span,
                'give per-stage models with `model="..."` in the stage',
            )
        self.graph.model = self.models[0].model if self.models else None
        self.graph.model_span = self.models[0].span if self.models else None
        for p in self.program.params:
            if p.name in self.graph.params:
                raise GraphError(f"parameter '{p.name}' is declared twice", p.span)
            if isinstance(p.default, (Param, ast.Name)):
                raise GraphError(f"parameter '{p.name}' needs a literal default", p.span)
            self.graph.params[p.name] = self.value(p.default, p.span)
        for s in self.program.stages:
            self.stage(s)
        for i in self.program.inputs:
            self.input(i)

    def _claim_name(self, name: str, span: Span) -> None:
        if name in self.graph:
            raise GraphError(
                f"'{name}' is already defined",
                span,
                "names of stages, inputs and outputs are shared",
            )

    def stage(self, s: ast.StageDecl) -> None:
        self._claim_name(s.name, s.span)
        if s.kind not in KINDS:
            raise _unknown("stage kind", s.kind, s.kind_span, KINDS, "kinds")
        kind = KINDS[s.kind]
        # The kind's own first (the hint lists them first), then a family's (checked later,
        # against the stage's model).
        specs = {**kind.params}
        specs.update((k, v) for k, v in families.extra_params(s.kind).items() if k not in specs)
        params, spans = {}, {}
        for attr in s.args:
            if attr.key in params:
                raise GraphError(f"parameter '{attr.key}' given twice", attr.span)
            params[attr.key] = self.checked(attr, specs, f"parameter of {s.kind}")
            spans[attr.key] = attr.value_span or attr.span
        for key, spec in kind.params.items():
            if spec.required and key not in params:
                raise GraphError(
                    f"stage '{s.name}' needs '{key}'", s.span, f"add `{key}=...` to {s.kind}(...)"
                )
        if kind.needs_model and "model" not in params and not self.graph.model:
            raise GraphError(
                f"stage '{s.name}' has no model",
                s.span,
                'add `model="org/name"` to the stage or a `model "..."` line to the pipeline',
            )
        if s.kind == "python":
            for key in ("inputs", "outputs"):
                for port, typ in parse_port_list(params.get(key, kind.params[key].default)).items():
                    if typ not in PORT_TYPES:
                        raise GraphError(
                            f"unknown port type '{typ}' for port '{port}'",
                            s.span,
                            suggest(typ, PORT_TYPES, "types"),
                        )
        if s.device is not None and not _DEVICE.match(s.device):
            raise GraphError(
                f"unknown device '{s.device}'", s.device_span or s.span, "use cpu, cuda or cuda:N"
            )
        self.graph.add_node(Node(s.name, s.kind, params, s.device, s.span, arg_spans=spans))

    def input(self, i: ast.InputDecl) -> None:
        self._claim_name(i.name, i.span)
        if i.type not in PORT_TYPES:
            raise _unknown("type", i.type, i.type_span, PORT_TYPES, "types")
        params = {"type": i.type}
        if i.default is not None:
            params["default"] = self.value(i.default, i.span)
        if i.optional:
            if i.default is not None:
                raise GraphError(
                    f"input '{i.name}' is optional and has a default; give one or the other",
                    i.span,
                    "an optional input (`type?`) a request leaves out sends nothing",
                )
            params["optional"] = True
        self.graph.add_node(Node(i.name, INPUT, params, span=i.span))

    # --- flows -------------------------------------------------------------------------
    def _node(self, name: str, span: Span) -> Node:
        if name in self.graph:
            return self.graph.node(name)
        known = [n.name for n in self.graph.nodes if n.op != OUTPUT]
        what = "stage" if not any(i.name == name for i in self.program.inputs) else "node"
        raise GraphError(f"unknown {what} '{name}'", span, did_you_mean(name, known))

    def source(self, ref: ast.PortRef) -> tuple[Node, str]:
        node = self._node(ref.node, ref.span)
        if node.op == OUTPUT:
            raise GraphError(f"'{node.name}' is an output and cannot feed anything", ref.span)
        outs = node.ports()[1]
        if ref.port is None:
            if len(outs) != 1:
                raise GraphError(
                    f"'{node.name}' has several outputs; name one",
                    ref.span,
                    f"write {node.name}.PORT with PORT one of {one_of(outs)}",
                )
            return node, next(iter(outs))
        if ref.port not in outs and (node.op, ref.port) in NOT_YET_PORTS:
            raise GraphError(NOT_YET_PORTS[node.op, ref.port], ref.span)
        if ref.port not in outs:
            raise GraphError(
                f"'{node.name}' has no output port '{ref.port}'",
                ref.span,
                suggest(ref.port, outs, "outputs"),
            )
        return node, ref.port

    def target(self, flow: ast.Flow, typ: str, out_attrs: dict) -> tuple[Node, str]:
        ref = flow.target
        if isinstance(ref, ast.OutputRef):
            if ref.name in self.graph:
                what = "output" if self.graph.node(ref.name).op == OUTPUT else "name"
                raise GraphError(
                    f"{what} '{ref.name}' is already used", ref.span, "each output has one producer"
                )
            return self.graph.add_node(
                Node(ref.name, OUTPUT, out_attrs, span=ref.span)
            ), OUTPUT_PORT
        node = self._node(ref.node, ref.span)
        if node.op == INPUT:
            raise GraphError(f"'{node.name}' is an input and cannot be fed", ref.span)
        ins = node.ports()[0]
        accepting = [p for p, types in ins.items() if typ in types]
        port = ref.port or (accepting[0] if accepting else None)
        reserved = NOT_YET_PORTS.get((node.op, ref.port or typ))
        if reserved and (ref.port is not None or port is None):
            raise GraphError(reserved, ref.span)
        if ref.port is not None and ref.port not in ins:
            raise GraphError(
                f"'{node.name}' has no input port '{ref.port}'",
                ref.span,
                suggest(ref.port, ins, "inputs"),
            )
        if port is None or typ not in ins[port]:
            src = flow.source
            wants = one_of(f"{p} ({'|'.join(t)})" for p, t in ins.items())
            raise GraphError(
                f"type mismatch: {src.node}{'.' + src.port if src.port else ''} gives {typ}, "
                f"but {node.name}{'.' + port if port else ''} takes "
                f"{'|'.join(ins[port]) if port else 'no ' + typ}",
                flow.span,
                f"{node.name} inputs: {wants}",
            )
        for e in self.graph.in_edges(node.name):
            if e.dst_port == port:
                raise GraphError(
                    f"{node.name}.{port} already has a producer ({e.src})",
                    ref.span,
                    "name another port" if ref.port is None else None,
                )
        return node, port

    def maps(self, ops: list[ast.MapOp], typ: str, span: Span) -> tuple[MapOp, ...]:
        if ops and typ not in TENSOR_TYPES:
            raise GraphError(f"map needs a tensor port, but this edge carries {typ}", span)
        result = []
        for op in ops:
            if op.name not in OPS:
                raise _unknown("map op", op.name, op.span, OPS, "ops")
            want = OPS[op.name].args
            if len(op.args) != len(want):
                raise GraphError(
                    f"'{op.name}' takes {len(want)} argument(s) ({', '.join(want)}), got {len(op.args)}",
                    op.span,
                )
            for arg in op.args:
                if isinstance(arg, bool) or not isinstance(arg, (int, float)):
                    raise GraphError(f"'{op.name}' arguments must be numbers, not {arg!r}", op.span)
            given = dict(zip(want, op.args, strict=True))
            ordered = [given[name] for name in OPS[op.name].ordered]
            if ordered != sorted(ordered):
                names = " <= ".join(OPS[op.name].ordered)
                raise GraphError(
                    f"'{op.name}' needs {names}, not {', '.join(map(str, ordered))}", op.span
                )
            result.append(MapOp(op.name, tuple(op.args)))
        return tuple(result)

    def flow(self, flow: ast.Flow) -> None:
        src, src_port = self.source(flow.source)
        typ = src.ports()[1][src_port]
        to_output = isinstance(flow.target, ast.OutputRef)
        specs = {**EDGE_ATTRS, **(OUTPUT_ATTRS if to_output else {})}
        attrs, seen = {}, set()
        for a in flow.attrs:
            if a.key in seen:
                raise GraphError(f"attribute '{a.key}' given twice", a.span)
            seen.add(a.key)
            attrs[a.key] = self.checked(a, specs, "edge attribute")
        adapter = attrs.get("adapter")
        if adapter is not None:
            typ = self.adapter(adapter.dotted, typ, flow)
        out_attrs = {k: attrs.pop(k) for k in list(attrs) if k in OUTPUT_ATTRS}
        dst, dst_port = self.target(flow, typ, out_attrs)
        self.graph.add_edge(
            Edge(
                src.name,
                src_port,
                dst.name,
                dst_port,
                typ,
                chunk=self.chunk(attrs, flow),
                context=attrs.get("context", 0),
                credits=attrs.get("credits"),
                adapter=adapter.dotted if adapter else None,
                maps=self.maps(flow.maps, typ, flow.span),
                span=flow.span,
            )
        )

    def adapter(self, name: str, typ: str, flow: ast.Flow) -> str:
        known = families.adapters()
        namespaces = {adapter.split(".")[0] for adapter in known}
        if name.split(".")[0] in namespaces and name not in known:
            raise _unknown("adapter", name, flow.span, known, "adapters")
        spec = known.get(name)
        if spec is None:
            return typ
        if spec.in_type != typ:
            raise GraphError(
                f"adapter '{name}' takes {spec.in_type}, but the edge carries {typ}", flow.span
            )
        return spec.out_type

    @staticmethod
    def chunk(attrs: dict, flow: ast.Flow):
        chunk = attrs.get("chunk")
        if attrs.get("whole") and (attrs.get("stream") or chunk is not None):
            raise GraphError("an edge cannot be both whole and streamed", flow.span)
        if chunk is None:
            chunk = AUTO if attrs.get("stream") else None
        sizes = chunk if isinstance(chunk, list) else [chunk] if isinstance(chunk, int) else []
        if (
            any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes)
            or chunk == []
        ):
            raise GraphError(f"chunk sizes must be positive integers, not {chunk!r}", flow.span)
        if chunk is None and attrs.get("context"):
            raise GraphError("left context needs a streamed edge", flow.span, "add `stream`")
        for key in ("context", "credits"):
            if attrs.get(key, 0) < 0 or (key == "credits" and attrs.get(key) == 0):
                raise GraphError(f"'{key}' must be positive", flow.span)
        return chunk

    # --- whole-graph checks ---------------------------------------------------------------
    def constraints(self) -> None:
        pairs: dict[str, set[frozenset]] = {"colocate": set(), "separate": set()}
        for c in self.program.constraints:
            for name, span in c.stages:
                node = self._node(name, span)
                if not node.is_stage:
                    raise GraphError(f"'{name}' is not a stage", span)
            names = tuple(name for name, _ in c.stages)
            if len(set(names)) != len(names):
                raise GraphError(f"{c.kind} names a stage twice", c.span)
            devices = {self.graph.node(n).device for n in names} - {None}
            if c.kind == "colocate" and len(devices) > 1:
                raise GraphError(
                    f"cannot colocate stages pinned to {one_of(sorted(devices))}", c.span
                )
            pairs[c.kind].update(frozenset((a, b)) for a in names for b in names if a != b)
            self.graph.constraints.append(Constraint(c.kind, names))
        clash = pairs["colocate"] & pairs["separate"]
        if clash:
            a, b = sorted(next(iter(clash)))
            raise GraphError(
                f"'{a}' and '{b}' are both colocated and separated",
                self.program.constraints[-1].span,
            )

    def structure(self) -> None:
        g = self.graph
        cycle = g.find_cycle()
        if cycle:
            closing = next(e for e in g.in_edges(cycle[0]) if e.src == cycle[-2])
            raise GraphError(
                "cycle: " + " -> ".join(cycle),
                closing.span,
                "pipelines are acyclic; remove one edge",
            )
        if not g.outputs:
            raise GraphError(
                "the pipeline has no output", self.program.span, "add a flow `... -> output NAME`"
            )
        cfg_inputs = {
            n.params["cfg"].dotted: n for n in g.stages if isinstance(n.params.get("cfg"), Ref)
        }
        for name, stage in cfg_inputs.items():
            self.cfg(name, stage)
        reaching = g.reaching_outputs()
        for node in g.nodes:
            if node.op == INPUT and not g.out_edges(node.name) and node.name not in cfg_inputs:
                raise GraphError(
                    f"input '{node.name}' is not connected",
                    node.span,
                    f"add `-> STAGE` to it, or use it as a guidance companion (cfg={node.name})",
                )
            if node.is_stage and not g.in_edges(node.name):
                raise GraphError(f"stage '{node.name}' has no input", node.span)
            if node.is_stage and node.name not in reaching:
                raise GraphError(
                    f"stage '{node.name}' reaches no output",
                    node.span,
                    f"connect one of its outputs: {one_of(node.ports()[1])}",
                )

    def cfg(self, name: str, stage: Node) -> None:
        g = self.graph
        inputs = [n.name for n in g.inputs]
        if name not in g or g.node(name).op != INPUT:
            raise GraphError(
                f"cfg names '{name}', which is not an input",
                stage.arg_spans["cfg"],
                suggest(name, inputs, "inputs"),
            )
        companion = g.node(name)
        if g.out_edges(name):
            raise GraphError(
                f"cfg input '{name}' must not be connected: it follows its partner's path",
                companion.span,
            )
        partners = [g.node(a) for a in g.ancestors(stage.name) if g.node(a).op == INPUT]
        if not any(p.params["type"] == companion.params["type"] for p in partners):
            raise GraphError(
                f"cfg input '{name}' ({companion.params['type']}) has no partner input of that type upstream of '{stage.name}'",
                companion.span,
            )


def build(program: ast.Pipeline) -> Graph:
    """Resolve names and check types of a parsed program; return its lint-clean Graph."""
    builder = _GraphBuilder(program)
    builder.declarations()
    for flow in program.flows:
        builder.flow(flow)
    builder.constraints()
    builder.structure()
    return builder.graph.lint()


def _unknown(what: str, name: str, span: Span, known, listed: str) -> GraphError:
    """The error for a `what` named `name` that is none of `known`: the nearest of them, or
    the `listed` ones (`suggest`)."""
    return GraphError(f"unknown {what} '{name}'", span, suggest(name, known, listed))
