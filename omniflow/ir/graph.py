"""The IR: a `Graph` of `Node`s (inputs, stages, outputs) joined by typed, port-to-port `Edge`s.

networkx holds the topology privately; callers see only this API. Nodes and edges carry a
`meta` dict that passes fill in (device, budget, executor, chunk schedule, ...); equality
ignores `meta` and source spans, so a graph equals its own `to_dsl()` round trip.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import networkx as nx

from omniflow import families
from omniflow.errors import LintError, Span
from omniflow.ir.kinds import KINDS, stage_ports
from omniflow.ir.types import PORT_TYPES
from omniflow.ir.values import format_value, resolve

INPUT, OUTPUT = "input", "output"
# The single port of an input node (out) and of an output node (in).
INPUT_PORT, OUTPUT_PORT = "out", "in"


@dataclass(frozen=True)
class MapOp:
    """One pointwise op of an edge's map chain: `clamp(-1, 1)`."""

    name: str
    args: tuple = ()

    def __str__(self) -> str:
        if not self.args:
            return self.name
        return f"{self.name}({', '.join(format_value(a) for a in self.args)})"


@dataclass(eq=False)
class Node:
    """An input, output, or stage. `op` is "input", "output" or a stage kind ("ar", ...).

    For inputs `params` holds `type` and optionally `default`; for outputs `rate`/`format`.
    """

    name: str
    op: str
    params: dict = field(default_factory=dict)
    device: str | None = None
    span: Span | None = None
    meta: dict = field(default_factory=dict)
    # Where a `.omni` file gives each of `params` (its value), for errors found later.
    arg_spans: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_stage(self) -> bool:
        return self.op not in (INPUT, OUTPUT)

    def key(self) -> tuple:
        return (self.name, self.op, tuple(sorted(self.params.items(), key=str)), self.device)

    def ports(self) -> tuple[dict[str, tuple[str, ...]], dict[str, str]]:
        """(input ports -> accepted types, output ports -> type)."""
        if self.op == INPUT:
            return {}, {INPUT_PORT: self.params["type"]}
        if self.op == OUTPUT:
            return {OUTPUT_PORT: PORT_TYPES}, {}
        ins, outs = stage_ports(self.op, self.params)
        return (
            {**ins, **families.extra_inputs(self.op)},
            {**outs, **families.extra_outputs(self.op)},
        )


@dataclass(eq=False)
class Edge:
    """A connection `src.src_port -> dst.dst_port`.

    `chunk` is None for a whole-output edge; an int, AUTO, or a list of sizes for a stream.
    `maps` is the pointwise chain applied to every item on the way.
    """

    src: str
    src_port: str
    dst: str
    dst_port: str
    type: str
    chunk: object = None
    context: int = 0
    credits: int | None = None
    adapter: str | None = None
    maps: tuple[MapOp, ...] = ()
    span: Span | None = None
    meta: dict = field(default_factory=dict)

    @property
    def stream(self) -> bool:
        return self.chunk is not None

    @property
    def name(self) -> str:
        return f"{self.src}.{self.src_port}->{self.dst}.{self.dst_port}"

    def key(self) -> tuple:
        chunk = tuple(self.chunk) if isinstance(self.chunk, list) else self.chunk
        return (
            self.src,
            self.src_port,
            self.dst,
            self.dst_port,
            self.type,
            chunk,
            self.context,
            self.credits,
            self.adapter,
            self.maps,
        )


@dataclass(frozen=True)
class Constraint:
    """`colocate` (same device) or `separate` (pairwise different devices) over stages."""

    kind: str
    stages: tuple[str, ...]


class Graph:
    """A pipeline as a dataflow graph. Build it with `omniflow.ir.from_ast.build` or
    `omniflow.Pipeline`."""

    def __init__(self, name: str, model: str | None = None, params: dict | None = None):
        self.name = name
        self.model = model
        self.model_span: Span | None = None  # where a `.omni` file declares `model`
        self.params: dict[str, object] = dict(params or {})
        self.constraints: list[Constraint] = []
        self.meta: dict = {}
        self._g = nx.MultiDiGraph()

    # --- construction -------------------------------------------------------------
    def add_node(self, node: Node) -> Node:
        if node.name in self._g:
            raise LintError(node.name, "defined twice")
        self._g.add_node(node.name, node=node)
        return node

    def add_edge(self, edge: Edge) -> Edge:
        for end in (edge.src, edge.dst):
            if end not in self._g:
                raise LintError(end, f"edge {edge.name} refers to a node that does not exist")
        self._g.add_edge(edge.src, edge.dst, edge=edge)
        return edge

    def copy(self) -> Graph:
        """A copy with its own params and meta dicts: passes return new graphs instead of
        mutating their input. Values inside meta are shared, so passes replace them, never
        change them in place."""
        other = Graph(self.name, self.model, self.params)
        other.model_span = self.model_span
        other.constraints = list(self.constraints)
        other.meta = dict(self.meta)
        for node in self.nodes:
            other.add_node(replace(node, params=dict(node.params), meta=dict(node.meta)))
        for edge in self.edges:
            other.add_edge(replace(edge, meta=dict(edge.meta)))
        return other

    # --- queries -------------------------------------------------------------------
    def node(self, name: str) -> Node:
        return self._g.nodes[name]["node"]

    def __contains__(self, name: str) -> bool:
        return name in self._g

    @property
    def nodes(self) -> list[Node]:
        return [data["node"] for _, data in self._g.nodes(data=True)]

    @property
    def edges(self) -> list[Edge]:
        return [data["edge"] for _, _, data in self._g.edges(data=True)]

    @property
    def stages(self) -> list[Node]:
        return [n for n in self.nodes if n.is_stage]

    @property
    def inputs(self) -> list[Node]:
        return [n for n in self.nodes if n.op == INPUT]

    @property
    def outputs(self) -> list[Node]:
        return [n for n in self.nodes if n.op == OUTPUT]

    def in_edges(self, name: str) -> list[Edge]:
        return [d["edge"] for _, _, d in self._g.in_edges(name, data=True)]

    def out_edges(self, name: str) -> list[Edge]:
        return [d["edge"] for _, _, d in self._g.out_edges(name, data=True)]

    def find_cycle(self) -> list[str] | None:
        """Node names along one cycle (first repeated at the end), or None if acyclic."""
        try:
            cycle = nx.find_cycle(self._g)
        except nx.NetworkXNoCycle:
            return None
        return [u for u, *_ in cycle] + [cycle[0][0]]

    def topo_order(self) -> list[Node]:
        """Nodes with every producer before its consumers (ties in definition order)."""
        order = {name: i for i, name in enumerate(self._g.nodes)}
        names = nx.lexicographical_topological_sort(self._g, key=order.__getitem__)
        return [self.node(n) for n in names]

    def ancestors(self, name: str) -> set[str]:
        return nx.ancestors(self._g, name)

    def descendants(self, name: str) -> set[str]:
        return nx.descendants(self._g, name)

    def param_value(self, node: Node, key: str):
        """A stage parameter's value as compiled: what the program gives (else its kind's
        default, or its model family's), with pipeline parameters at their defaults."""
        specs = KINDS[node.op].params
        spec = specs[key] if key in specs else families.extra_params(node.op)[key]
        return resolve(node.params.get(key, spec.default), self.params)

    def reaching_outputs(self) -> set[str]:
        """Names of the nodes from which some output can be reached."""
        reach: set[str] = set()
        for out in self.outputs:
            if out.name not in reach:
                reach |= nx.ancestors(self._g, out.name) | {out.name}
        return reach

    # --- invariants ----------------------------------------------------------------
    def lint(self) -> Graph:
        """Check the graph's invariants; raise LintError naming the first bad node."""
        for node in self.nodes:
            if node.is_stage and node.op not in KINDS:
                raise LintError(node.name, f"unknown stage kind '{node.op}'")
        for edge in self.edges:
            src, dst = self.node(edge.src), self.node(edge.dst)
            outs, ins = src.ports()[1], dst.ports()[0]
            if edge.src_port not in outs:
                raise LintError(src.name, f"has no output port '{edge.src_port}'")
            if edge.dst_port not in ins:
                raise LintError(dst.name, f"has no input port '{edge.dst_port}'")
            if edge.type not in ins[edge.dst_port]:
                raise LintError(dst.name, f"port '{edge.dst_port}' does not accept {edge.type}")
        for node in self.nodes:
            taken = [e.dst_port for e in self.in_edges(node.name)]
            for port in set(taken):
                if taken.count(port) > 1:
                    raise LintError(
                        node.name, f"input port '{port}' has {taken.count(port)} producers"
                    )
        cycle = self.find_cycle()
        if cycle:
            raise LintError(cycle[0], "is on a cycle: " + " -> ".join(cycle))
        reaching = self.reaching_outputs()
        for node in self.stages:
            if not self.in_edges(node.name):
                raise LintError(node.name, "has no input")
            if node.name not in reaching:
                raise LintError(node.name, "reaches no output")
        return self

    # --- equality and printing -------------------------------------------------------
    def _key(self) -> tuple:
        return (
            self.name,
            self.model,
            tuple(sorted(self.params.items())),
            tuple(sorted(self.constraints, key=repr)),
            tuple(sorted(n.key() for n in self.nodes)),
            tuple(sorted((e.key() for e in self.edges), key=repr)),
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Graph) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        from omniflow.ir.printer import format_graph

        return format_graph(self)

    def to_dsl(self) -> str:
        """`.omni` source that parses and builds back to a graph equal to this one."""
        from omniflow.ir.printer import to_dsl

        return to_dsl(self)
