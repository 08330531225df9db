"""Pass: chunk sizing. Every streamed edge gets `meta["schedule"]`, the chunk sizes (in
steps) its producer sends, the last repeating. `chunk=N` is [N]; `chunk=auto` is derived
from the stages' cost estimates:

- steady chunk: the smallest n for which the consumer's fixed per-call overhead is at most
  10 % of a call and re-decoded left context at most half of it (n >= context);
- first chunk: the smallest n for which decoding a chunk takes no longer than producing the
  next (doubled) one, so the consumer never starves; then sizes double up to steady.

Small first chunks give a low time to first packet; large steady chunks, throughput.

A vocoder that carries each stream's state from one chunk to the next (its family says:
`ComponentConfig.carries_state`, Qwen3-TTS's code2wav) re-decodes no left context, so a
chunk costs its own frames and the call's overhead, and the edge's `context` is not used (a
warning says so where a program declares one; the edge is marked `carries_state`, which the
plan prints), and on a GPU gets `plays_s`, the seconds of audio a frame plays for, by which
the runtime paces its chunks (runtime/slack.py: the schedule widens only while the stream is
ahead of its listener). Its first chunk is the smallest n whose audio plays at least as long
as making and decoding the next, twice as long, chunk takes: after it the listener never
waits, so the first packet leaves after a single frame wherever a frame is made and decoded
well within the time it plays.

A vocoder that decodes on a grid of blocks (Qwen2.5-Omni token2wav) cannot use codes before
a whole window and its lookahead exist, so its input edge's schedule is what each of its
windows needs to arrive (`vocoder_windows` in the model catalog: 36, 24, 48, then 192
codes for token2wav; with the stage's `lookahead=12`, 24 first) and its output's is what
each window keeps (12, 24, 48, 192).
"""

from __future__ import annotations

import math

from omniflow.catalog.components import vocoder_windows
from omniflow.ir.graph import OUTPUT, Edge, Graph, Node
from omniflow.passes.common import Target

READS = ("model", "cost", "placement")
WRITES = ("schedule", "carries_state", "plays_s", "warnings")

# Fixed cost of one consumer call: a cross-process hop plus a forward's launch overhead.
CALL_OVERHEAD_S = {"gpu": 2e-3, "cpu": 1e-3}
# Past this many steps a chunk buys little throughput but delays every packet behind it.
MAX_STEADY = 64
OVERHEAD_SHARE = 0.10


def _device(target: Target, node: Node):
    placement = node.meta.get("placement")
    device = placement.device if placement is not None else None
    return next((d for d in target.devices if d.name == device), target.devices[0])


def step_seconds(target: Target, node: Node) -> float:
    """Seconds one request waits per step of `node` at full batch (memory- or compute-bound)."""
    facts = node.meta.get("cost")
    if facts is None or facts.cost is None:
        return 1e-3
    dev, cost = _device(target, node), facts.cost
    return max(cost.weight_bytes / dev.bandwidth, cost.flops_per_item * facts.batch / dev.flops)


def item_seconds(target: Target, node: Node) -> float:
    """Seconds of compute per item for the consumer (one frame, one token)."""
    facts = node.meta.get("cost")
    cost = facts.cost if facts is not None else None
    return cost.flops_per_item / _device(target, node).flops if cost else 1e-5


def auto_schedule(
    target: Target, producer: Node, consumer: Node, context: int, plays: float | None = None
) -> list[int]:
    """`plays`: seconds of audio a step plays for, for a consumer that carries its state
    (its `context` is then 0); None for one that re-decodes `context` steps each chunk."""
    overhead = CALL_OVERHEAD_S["gpu" if _device(target, consumer).is_gpu else "cpu"]
    per_item = max(item_seconds(target, consumer), 1e-9)
    per_step = step_seconds(target, producer)
    steady = math.ceil((1 - OVERHEAD_SHARE) / OVERHEAD_SHARE * overhead / per_item) - context
    steady = min(MAX_STEADY, max(steady, context, 1))
    if plays is None:
        # Decode chunk n (with context) within the time the producer makes the next 2n steps.
        denom, fixed = 2 * per_step - per_item, overhead + per_item * context
    else:
        # Chunk n plays while the next 2n steps are made and decoded (one call's overhead).
        denom, fixed = plays - 2 * (per_step + per_item), overhead
    first = steady if denom <= 0 else max(1, math.ceil(fixed / denom))
    schedule = [min(first, steady)]
    while schedule[-1] < steady:
        schedule.append(min(schedule[-1] * 2, steady))
    return schedule


def _schedule(graph: Graph, target: Target, edge: Edge) -> list[int]:
    if isinstance(edge.chunk, int):
        return [edge.chunk]
    if isinstance(edge.chunk, list):
        return list(edge.chunk)
    src, dst = graph.node(edge.src), graph.node(edge.dst)
    if dst.op == OUTPUT or not src.is_stage:
        return _calls(graph, src)  # to a client, every call's output goes out as soon as it exists
    windows = _windows(graph, dst)
    if windows is not None:
        return windows[1]
    if edge.meta["carries_state"]:
        rate = dst.meta["model"].config.frame_rate
        return auto_schedule(target, src, dst, 0, 1 / rate if rate else None)
    return auto_schedule(target, src, dst, edge.context)


def _carries_state(graph: Graph, edge: Edge) -> bool:
    """Whether the edge streams into a vocoder that carries each stream's state."""
    dst = graph.node(edge.dst)
    return edge.stream and dst.op == "vocoder" and dst.meta["model"].config.carries_state


def _plays(graph: Graph, target: Target, edge: Edge) -> float | None:
    """Seconds of audio a step of a carried-state edge plays for (its vocoder's frame), by
    which the runtime paces its chunks; None elsewhere, and where the vocoder runs on a CPU:
    pacing makes a stream's windows depend on timing, which moves its audio by rounding,
    and a CPU plan (the reference, the tests) keeps its runs bit for bit."""
    if not edge.meta["carries_state"]:
        return None
    dst = graph.node(edge.dst)
    rate = dst.meta["model"].config.frame_rate
    return 1 / rate if rate and _device(target, dst).is_gpu else None


def _windows(graph: Graph, node: Node) -> tuple[list[int], list[int]] | None:
    if node.op != "vocoder":
        return None
    return vocoder_windows(node.meta["model"].config, graph.param_value(node, "lookahead"))


def _calls(graph: Graph, node: Node) -> list[int]:
    """Steps one call of `node` emits: a chunk consumer emits what each input chunk gives, a
    block-grid vocoder what each of its windows keeps."""
    windows = _windows(graph, node)
    if windows is not None:
        return windows[0]
    fed = [e for e in graph.in_edges(node.name) if e.stream and e.meta.get("schedule")]
    return fed[0].meta["schedule"] if node.op == "vocoder" and fed else [1]


def size_chunks(graph: Graph, target: Target) -> Graph:
    graph = graph.copy()
    warnings = list(graph.meta.get("warnings", ()))
    for node in graph.topo_order():
        for edge in graph.out_edges(node.name):
            edge.meta["carries_state"] = _carries_state(graph, edge)
            edge.meta["plays_s"] = _plays(graph, target, edge)
            if edge.meta["carries_state"] and edge.context:
                warnings.append(
                    f"{edge.name}: context={edge.context} is not used: {edge.dst} carries "
                    "its decoder's state from one chunk to the next"
                )
            schedule = _schedule(graph, target, edge) if edge.stream else None
            edge.meta["schedule"] = tuple(schedule) if schedule is not None else None
    graph.meta["warnings"] = tuple(warnings)
    return graph
