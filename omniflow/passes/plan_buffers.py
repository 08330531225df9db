"""Pass: buffer planning. Every edge that crosses executors (the frontend included) gets a
pre-allocated ring: `meta["channel"]`, a `Channel`: its kind, slots, slot bytes, credits and
the device that holds it. A slot holds the largest message the edge can carry (the largest
chunk of the schedule, or the whole output); there are `credits` slots per request the
consumer may batch, so a producer can run `credits` chunks ahead per request before it
blocks, and before a stage that passes each request once, room for every request the
pipeline serves at once (`_slots`).

The kind says how chunks move, from where the two ends run (`edge_kind`):
- `local`: one executor; references, no bytes.
- `cuda-ipc`: two processes on one GPU passing tensors: a ring in that GPU's memory, which
  the other process opens through a CUDA IPC handle; no host round trip.
- `p2p`: tensors between two GPUs of one host: a ring in the consumer's GPU memory, filled
  by a peer copy from the producer's GPU.
- `net`: the ends run on different nodes: frames over the network into pre-allocated slots.
- `shm`: everything else (text, the frontend, CPU stages): a host shared-memory ring.
All kinds share the slot layout, the doorbell headers and the credits.

It also warns of a stage that holds requests feeding a narrower one (`_idle_slots`): the
narrowest admits, and the wider one's slots past it never fill.
"""

from __future__ import annotations

from dataclasses import replace

from omniflow.devices import GiB, node_of
from omniflow.errors import PlacementError
from omniflow.ir.graph import Edge, Graph, Node
from omniflow.ir.kinds import KINDS, requests_at_once
from omniflow.ir.types import TENSOR_TYPES
from omniflow.passes.common import Target
from omniflow.passes.facts import Channel

READS = ("cost", "placement", "executor", "item", "schedule")
WRITES = ("channel", "placement", "shm_bytes", "warnings")

DEFAULT_CREDITS = 2
SLOT_ALIGN = 64
# Rings larger than this get fewer slots (never under one request's credits), with a warning.
RING_CAP = 1 * GiB


def _align(n: int) -> int:
    return -(-n // SLOT_ALIGN) * SLOT_ALIGN


def _slots(graph: Graph, edge: Edge, credits: int, at_once: int) -> int:
    """`credits` slots per request the consumer batches (the producer's batch if a client
    reads). Before a stage that passes each request once (not `holds_requests`: an encoder,
    a VAE), room too for every request the pipeline serves at once (`at_once`) to have its
    input there before the stage takes it in: one slot each for a whole edge, `credits` for
    a stream (a producer finding its ring full waits, and a frontend waiting stalls every
    request)."""
    for name in (edge.dst, edge.src):
        node = graph.node(name)
        if node.is_stage:
            slots = credits * graph.param_value(node, "max_batch")
            if name == edge.dst and not KINDS[node.op].holds_requests:
                slots = max(slots, at_once * (credits if edge.stream else 1))
            return slots
    return credits


def edge_kind(graph: Graph, target: Target, edge: Edge) -> tuple[str, str]:
    """How `edge` moves its chunks, and the device that holds its ring ("" for a host ring):
    see the module's docstring. The frontend runs on the first node of the inventory."""
    src, dst = graph.node(edge.src), graph.node(edge.dst)
    if src.meta["executor"] == dst.meta["executor"]:
        return "local", ""
    home = node_of(target.devices[0].name) if target.devices else ""
    ends = [n.meta["placement"].devices if n.is_stage else () for n in (src, dst)]
    nodes = {node_of(d) for d in ends[0] + ends[1]} | ({home} if () in ends else set())
    if len(nodes) > 1:
        return "net", ""
    gpus = {d.name for d in target.devices if d.is_gpu}
    # A device ring needs a GPU at each end and a tensor that can stay there (text and chat
    # travel as host bytes).
    if edge.type in TENSOR_TYPES and all(len(e) == 1 and e[0] in gpus for e in ends):
        return ("cuda-ipc" if ends[0] == ends[1] else "p2p"), ends[1][0]
    return "shm", ""


def _room(node: Node) -> int:
    """What a stage's budget holds beyond its need: its share of its device's slack."""
    placement = node.meta["placement"]
    return placement.budget - placement.need


def _charge_device_ring(graph: Graph, edge: Edge, ring_bytes: int) -> None:
    """A device ring lives in its consumer's GPU memory: it comes out of the slack placement
    shared out as budgets on that GPU, never on top of them: out of the consumer's budget,
    or where that has no room (a stage without a KV cache beside one that has, which took
    the slack), out of the budget with the most room on that GPU."""
    consumer = graph.node(edge.dst)
    device = consumer.meta["placement"].device
    beside = [n for n in graph.stages if n.meta["placement"].device == device]
    payer = consumer if _room(consumer) >= ring_bytes else max(beside, key=_room)
    if _room(payer) < ring_bytes:
        raise PlacementError(
            f"the {ring_bytes / GiB:.1f} GiB device ring of {edge.name} does not fit beside "
            f"stage '{consumer.name}' on {device}; lower the consumer's max_batch or the "
            "edge's credits"
        )
    placement = payer.meta["placement"]
    payer.meta["placement"] = replace(placement, budget=placement.budget - ring_bytes)


def _idle_slots(graph: Graph, at_once: int) -> list[str]:
    """A stage that holds its requests feeding, directly or not, a narrower one that does:
    a request holds a slot in every such stage until it ends, so the narrowest admits, and
    the wider producer's slots past it never fill, which the plan says. (A consumer wider
    than its producer is headroom for streams that outlive their producer's part, when
    more requests are let in than the plan serves at once.)"""
    held = {
        n.name: graph.param_value(n, "max_batch")
        for n in graph.stages
        if KINDS[n.op].holds_requests
    }
    warnings = []
    for wide, batch in held.items():
        after = sorted(n for n in graph.descendants(wide) & held.keys() if held[n] == at_once)
        if after and batch > at_once:
            warnings.append(
                f"stage '{wide}' holds {batch} requests, but '{after[0]}' after it holds "
                f"{at_once}: the pipeline serves {at_once} at once; {batch - at_once} slots "
                f"of '{wide}' stay empty"
            )
    return warnings


def plan_buffers(graph: Graph, target: Target) -> Graph:
    graph = graph.copy()
    at_once = requests_at_once((n.op, graph.param_value(n, "max_batch")) for n in graph.stages)
    warnings = [*graph.meta.get("warnings", ()), *_idle_slots(graph, at_once)]
    total = 0
    for edge in graph.edges:
        kind, device = edge_kind(graph, target, edge)
        if kind == "local":
            edge.meta["channel"] = Channel("local")
            continue
        item = edge.meta["item"]
        steps = max(edge.meta["schedule"]) if edge.stream else item.max_steps
        slot_bytes = _align(item.item.item_bytes() * steps)
        credits = edge.credits or DEFAULT_CREDITS
        slots = _slots(graph, edge, credits, at_once)
        if slots * slot_bytes > RING_CAP and slots > credits:
            fewer = max(credits, RING_CAP // slot_bytes)
            warnings.append(
                f"{edge.name}: ring capped at {fewer} slots of {slot_bytes} bytes (wanted {slots})"
            )
            slots = fewer
        edge.meta["channel"] = Channel(kind, slots, slot_bytes, credits, device)
        if device:
            _charge_device_ring(graph, edge, slots * slot_bytes)
        else:
            total += slots * slot_bytes
    graph.meta["shm_bytes"] = total
    graph.meta["warnings"] = tuple(warnings)
    return graph
