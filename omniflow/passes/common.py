"""What several passes share, so that no pass imports another: the `Target` they compile
for, the stage facts more than one pass reads (a stage's dtype, the guidance path, the
tokens an input image adds, whether it shares its GPU's process), and the disjoint sets
that group stages.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from omniflow.devices import Device, GiB, local_name
from omniflow.errors import GraphError
from omniflow.ir.graph import INPUT, Graph, Node
from omniflow.ir.values import Ref

# A stream whose chunks are at most this many steps hands off per token: placement keeps
# its ends on one device and stage fusion puts them in one process.
PER_TOKEN_CHUNK = 4


@dataclass(frozen=True)
class Target:
    """What the passes compile for: the device inventory and the knobs they share."""

    devices: tuple[Device, ...]
    # Per executor process on a GPU (one per GPU, plus one per isolated stage): CUDA context,
    # allocator slack, kernels.
    process_overhead: int = 1 * GiB
    # Per GPU stage with a need (a model), beside its estimate: the math libraries' workspace
    # of its own CUDA stream (cuBLAS 32 MiB and cuBLASLt 1 MiB on the first product a new
    # stream runs, torch 2.11 on an H100: allocations its load is measured by).
    stream_workspace: int = 33 << 20
    # Fraction of each device's memory left unassigned as a safety margin.
    reserve: float = 0.05
    overrides: dict = field(default_factory=dict)


def on_gpus(devices: tuple[str, ...]) -> bool:
    """Whether these devices (a stage's placement) are all GPUs."""
    return bool(devices) and all(local_name(d).startswith("cuda") for d in devices)


def isolated(graph: Graph, node: Node) -> bool:
    """Whether the stage asked for a process of its own (`isolate=true`)."""
    return bool(graph.param_value(node, "isolate"))


def shares_gpu_process(graph: Graph, node: Node, devices: tuple[str, ...]) -> bool:
    """The executor rule's first half: a stage on GPUs runs in the one process of its device
    set, beside every other stage there, unless it asked to stay apart. Placement charges a
    CUDA context per such process, stage fusion forms it."""
    return on_gpus(devices) and not isolated(graph, node)


def stage_dtype(graph: Graph, node: Node) -> str:
    """The dtype the program asks for, else the model's own (token2wav runs in float32)."""
    if "dtype" in node.params:
        return graph.param_value(node, "dtype")
    return node.meta["model"].config.dtype


def takes_image(graph: Graph, node: Node) -> bool:
    """Whether anything flows into the stage's `image` port."""
    return any(e.dst_port == "image" for e in graph.in_edges(node.name))


def condition_image_tokens(graph: Graph, node: Node) -> int:
    """Tokens a pipeline's text encoder or DiT spends on the input image it is conditioned on
    (an edit pipeline's): the count its config carries (`condition_image_tokens`, from the
    catalog); 0 for a model conditioned on no image, or for a vision tower (there the image
    is the whole input, bounded by `max_len`). A GraphError when the stage's image port and
    its model disagree."""
    cfg = node.meta["model"].config
    if cfg.category not in ("text_encoder", "dit"):
        return 0
    tokens = cfg.config.get("condition_image_tokens")
    if tokens is not None and cfg.config.get("condition_image_optional"):
        return tokens if takes_image(graph, node) else 0  # a model that works either way
    if takes_image(graph, node) != (tokens is not None):
        what, fix = (
            ("is not conditioned on an input image", "leave its image port unconnected")
            if tokens is None
            else ("is conditioned on an input image", "connect one to its image port")
        )
        raise GraphError(
            f"stage '{node.name}': {cfg.model} [{cfg.component}] {what}", node.span, fix
        )
    return tokens or 0


def cfg_path(graph: Graph) -> dict[str, str]:
    """Stages that process an unconditional companion too (from its partner input to the
    guided stage), each mapped to the companion input's name."""
    doubled: dict[str, str] = {}
    for guided in graph.stages:
        companion = guided.params.get("cfg")
        if not isinstance(companion, Ref):
            continue
        kind = graph.node(companion.dotted).params["type"]
        partners = [
            a
            for a in graph.ancestors(guided.name)
            if graph.node(a).op == INPUT and graph.node(a).params["type"] == kind
        ]
        reach = set().union(*(graph.descendants(p) for p in partners))
        for name in reach & (graph.ancestors(guided.name) | {guided.name}):
            if graph.node(name).is_stage:
                doubled[name] = companion.dotted
    return doubled


class DisjointSets:
    """Union-find over a fixed set of items: which stages must end up together."""

    def __init__(self, items: Iterable[Hashable]):
        self._parent = {item: item for item in items}

    def find(self, item: Hashable) -> Hashable:
        """The representative of `item`'s set."""
        while self._parent[item] != item:
            item = self._parent[item]
        return item

    def union(self, keep: Hashable, join: Hashable) -> None:
        """Merge `join`'s set into `keep`'s (whose representative stays)."""
        self._parent[self.find(join)] = self.find(keep)

    def sets(self, order: Iterable[Hashable]) -> list[list[Hashable]]:
        """Every set, its members and the sets themselves in the order of `order`."""
        members: dict[Hashable, list[Hashable]] = {}
        for item in order:
            members.setdefault(self.find(item), []).append(item)
        return list(members.values())
