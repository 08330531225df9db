"""Pass: placement. Every stage gets a device and an explicit memory budget in bytes
(`meta["placement"]`, a `Placement`), so nobody writes a memory fraction by hand; the graph
gets each device's use (`meta["devices"]`).

Stages are placed largest first, honoring pins and colocate/separate constraints. A stage
prefers the device of a neighbour it exchanges per-token streams with (so stage fusion can
remove the hop), then a device on that neighbour's node (on a cluster only chunked edges
should cross nodes; a per-token stream that must is warned about), then the device left
least full. The placement says where and why. A device is charged its stages' needs and a
CUDA context per executor process on it: one for the process its stages share, one more per
stage that asked to be isolated (the executor rule, `common.shares_gpu_process`). What a
device has beyond that is shared out as budget in proportion to the stages' KV caches (more
concurrent requests), or to their needs when no stage there has one, or equally when none
states a need; a budget is what the
stage's own allocations may reach, the context is not in it. A device's total is its stages'
budgets plus its contexts (`DeviceUse`): what the plan expects it to hold at most. A pipeline that cannot fit
fails here, naming the stage, the bytes it needs and the bytes available.
"""

from __future__ import annotations

from collections import defaultdict

from omniflow.devices import Device, GiB, human_bytes, node_of, parse_devices
from omniflow.errors import PlacementError
from omniflow.ir.graph import Graph, Node
from omniflow.passes.common import PER_TOKEN_CHUNK, DisjointSets, Target, shares_gpu_process
from omniflow.passes.facts import DeviceUse, Placement

READS = ("cost",)
WRITES = ("placement", "devices", "warnings")


def gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def _groups(graph: Graph) -> list[list[Node]]:
    """Stages that must share a device (colocate constraints), as lists; singletons included."""
    together = DisjointSets(n.name for n in graph.stages)
    for c in graph.constraints:
        if c.kind == "colocate":
            for other in c.stages[1:]:
                together.union(c.stages[0], other)
    return [
        [graph.node(name) for name in names]
        for names in together.sets(n.name for n in graph.stages)
    ]


def _need_text(node: Node) -> str:
    facts = node.meta["cost"]
    cost = facts.cost
    if cost is None or "memory" in node.params:
        return gib(facts.need)
    return (
        f"{gib(facts.need)} (weights {gib(cost.weight_bytes)} + KV cache {gib(cost.kv_cache_bytes)}"
        f" + activations {gib(cost.activation_bytes)}, batch {facts.batch})"
    )


def _batch_that_fits(node: Node, missing: int) -> str:
    """Where an `ar` stage lacks `missing` bytes of a device, the largest max_batch whose KV
    cache would leave them ("at max_batch=N ... it fits there; "), else ""."""
    facts = node.meta["cost"]
    if node.op != "ar" or facts.cost is None or "memory" in node.params or facts.batch < 2:
        return ""
    per_request = facts.cost.kv_cache_bytes // facts.batch
    if not per_request:
        return ""
    batch = facts.batch - -(-missing // per_request)  # the slots to give up, rounded up
    if batch < 1:
        return ""
    return (
        f"at max_batch={batch} (KV cache {human_bytes(per_request)} a request) it alone would "
        f"fit there (--set {node.name}.max_batch={batch}); "
    )


class _Placer:
    def __init__(self, graph: Graph, target: Target):
        self.graph = graph
        self.target = target
        self.devices: dict[str, Device] = {d.name: d for d in target.devices}
        self.capacity = {d.name: int(d.memory * (1 - target.reserve)) for d in target.devices}
        self.used: dict[str, int] = defaultdict(int)
        self.contexts: dict[str, int] = defaultdict(int)  # per device, its processes' contexts
        self.where: dict[str, list[str]] = {}
        self.placed: dict[str, list[str]] = defaultdict(list)  # per device, why there
        self.budget: dict[str, int] = {}
        self.need: dict[str, int] = {}  # of each budget, what the stage's load needs
        self.shared_process: set[str] = set()  # GPUs whose stages' shared process is charged
        self.separate = defaultdict(set)
        for c in graph.constraints:
            if c.kind == "separate":
                for a in c.stages:
                    self.separate[a] |= set(c.stages) - {a}

    def _processes(self, group: list[Node], device: str) -> int:
        """The executor processes placing `group` on `device` adds, each a CUDA context: one
        per isolated stage, and the device's shared one if it holds none yet (none off a GPU)."""
        if not self.devices[device].is_gpu:
            return 0
        sharing = [n for n in group if shares_gpu_process(self.graph, n, (device,))]
        return len(group) - len(sharing) + bool(sharing and device not in self.shared_process)

    def _need(self, node: Node, device: str) -> int:
        """What `node` needs on `device`: its estimate, and on a GPU its stream's library
        workspace (not beside an explicit `memory=`, which is the whole budget; a stage that
        needs nothing has no budget to hold it to)."""
        need = node.meta["cost"].need
        estimated = need and "memory" not in node.params
        return (
            need + self.target.stream_workspace
            if estimated and self.devices[device].is_gpu
            else need
        )

    def _charge(self, group: list[Node], device: str) -> int:
        """What placing `group` on `device` takes of it: the stages' needs and the contexts of
        the processes it adds."""
        needs = sum(self._need(n, device) for n in group)
        return needs + self._processes(group, device) * self.target.process_overhead

    def _pinned_device(self, node: Node) -> str | None:
        pin = node.device
        if pin is None or pin == "cuda":
            return None
        if pin == "cpu" and "cpu" not in self.devices:
            self.devices["cpu"] = parse_devices("cpu")[0]
            self.capacity["cpu"] = int(self.devices["cpu"].memory * (1 - self.target.reserve))
        if pin not in self.devices:
            raise PlacementError(
                f"stage '{node.name}' is pinned to {pin}, but the devices are {', '.join(self.devices)}"
            )
        return pin

    def _candidates(self, group: list[Node]) -> list[str]:
        pins = {p for p in map(self._pinned_device, group) if p}
        if len(pins) > 1:
            raise PlacementError(
                f"colocated stages {', '.join(n.name for n in group)} are pinned to different devices"
            )
        names = list(pins) or [
            d
            for d, dev in self.devices.items()
            if (dev.is_gpu or not any(x.is_gpu for x in self.target.devices))
        ]
        if any(n.device == "cuda" for n in group):
            names = [d for d in names if self.devices[d].is_gpu]
        avoid = set().union(*(self.separate[n.name] for n in group))
        return [d for d in names if not any(d in self.where.get(s, ()) for s in avoid)]

    def _streaming_neighbours(self, group: list[Node]) -> list[str]:
        """Stages that exchange per-token streams with `group`, one entry per stream."""
        out = []
        for node in group:
            for edge in self.graph.in_edges(node.name) + self.graph.out_edges(node.name):
                if isinstance(edge.chunk, int) and edge.chunk <= PER_TOKEN_CHUNK:
                    out.append(edge.src if edge.dst == node.name else edge.dst)
        return out

    def _affinity(self, group: list[Node], device: str) -> tuple[int, int]:
        """Per-token streams between `group` and stages already on `device`, then on its node:
        a stream that cannot stay on one device should at least stay within a node, where
        its hop is a device or shared-memory ring instead of the network."""
        node = node_of(device)
        neighbours = self._streaming_neighbours(group)
        on_device = sum(device in self.where.get(n, ()) for n in neighbours)
        on_node = sum(any(node_of(d) == node for d in self.where.get(n, ())) for n in neighbours)
        return on_device, on_node

    def _why(self, group: list[Node], device: str, fits: list[str]) -> str:
        """Why `group` went to `device`, for the plan."""
        if any(self._pinned_device(n) for n in group):
            return f"pinned to {device}"
        near = sorted(
            {n for n in self._streaming_neighbours(group) if n in self.where}
            & {s for s, ds in self.where.items() if device in ds or _same_node(ds, device)}
        )
        if near and any(device in self.where[n] for n in near):
            return f"with {', '.join(near)}: per-token streams stay on one device"
        if near and node_of(device):
            return (
                f"on {node_of(device)} with {', '.join(near)}: per-token streams stay within a "
                "node (no room on their device)"
            )
        if len(fits) == 1:
            return "the only device with room"
        return "the least full device with room"

    def place_group(self, group: list[Node]) -> None:
        candidates = self._candidates(group)
        if not candidates:
            raise PlacementError(
                f"no device left for {', '.join(n.name for n in group)}: "
                "pins and separate constraints exclude every device"
            )
        fits = [d for d in candidates if self.used[d] + self._charge(group, d) <= self.capacity[d]]
        if not fits:
            self._fail(group, candidates)
        best = max(fits, key=lambda d: (self._affinity(group, d), -self.used[d] / self.capacity[d]))
        why = self._why(group, best, fits)
        self.contexts[best] += self._processes(group, best)
        self.used[best] += self._charge(group, best)
        if any(shares_gpu_process(self.graph, n, (best,)) for n in group):
            self.shared_process.add(best)
        for n in group:
            self.where.setdefault(n.name, []).append(best)
            self.placed[n.name].append(f"{best}: {why}")

    def _fail(self, group: list[Node], candidates: list[str]) -> None:
        roomiest = max(candidates, key=lambda d: self.capacity[d] - self.used[d])
        free = self.capacity[roomiest] - self.used[roomiest]
        there = [s for s, ds in self.where.items() if roomiest in ds]
        verb = "holds" if len(there) == 1 else "hold"
        held = f"; {', '.join(there)} already {verb} {gib(self.used[roomiest])}" if there else ""
        who = group[0] if len(group) == 1 else None
        charge = self._charge(group, roomiest)
        need = _need_text(who) if who else gib(charge)
        if who:  # what placing it there takes beside its estimate
            context = self._processes(group, roomiest) * self.target.process_overhead
            workspace = self._need(who, roomiest) - who.meta["cost"].need
            beside = [f"{human_bytes(context)} for its process's CUDA context"] if context else []
            beside += [f"{human_bytes(workspace)} for its stream's workspace"] if workspace else []
            need += "".join(f" + {part}" for part in beside)
        name = (
            f"stage '{who.name}'" if who else f"colocated stages {', '.join(n.name for n in group)}"
        )
        fits = _batch_that_fits(who, charge - free) if who else ""
        raise PlacementError(
            f"{name} needs {need}, but the roomiest device {roomiest} has {gib(free)} free "
            f"(of {gib(self.capacity[roomiest])} usable{held}); {fits}add devices, lower "
            "max_batch/max_len, or give the stage an explicit memory=... budget"
        )

    def budgets(self) -> None:
        for device in self.capacity:
            here = [self.graph.node(s) for s, ds in self.where.items() if device in ds]
            slack = self.capacity[device] - self.used[device]
            costs = {n.name: n.meta["cost"] for n in here}
            weight = {s: c.cost.kv_cache_bytes if c.cost else 0 for s, c in costs.items()}
            if not any(weight.values()):
                weight = {s: c.need for s, c in costs.items()}
            if not any(weight.values()):  # none states a need (python stages): equal shares
                weight = dict.fromkeys(costs, 1)
            total = sum(weight.values()) or 1
            for n in here:
                self.need[n.name] = self._need(n, device)
                self.budget[n.name] = self.need[n.name] + slack * weight[n.name] // total

    def use(self, device: str, node_id: str) -> DeviceUse:
        """What the plan gives out of `device`: its stages' needs and budgets, and the CUDA
        contexts of the executor processes on it, which no budget holds."""
        budgets = sum(self.budget[s] for s, ds in self.where.items() if device in ds)
        contexts = self.contexts[device]
        context_bytes = self.target.process_overhead
        return DeviceUse(
            device,
            self.used[device],
            self.capacity[device],
            node_id,
            contexts=contexts,
            context_bytes=context_bytes,
            total=budgets + contexts * context_bytes,
        )


def _same_node(devices: list[str], device: str) -> bool:
    return bool(node_of(device)) and any(node_of(d) == node_of(device) for d in devices)


def _warn_streams_across_nodes(graph: Graph, where: dict[str, list[str]]) -> None:
    """Only chunked edges should cross nodes: a per-token stream that had to pays a network
    hop per token, which the plan says."""
    warnings = list(graph.meta.get("warnings", ()))
    for edge in graph.edges:
        if edge.src not in where or edge.dst not in where:
            continue
        small = isinstance(edge.chunk, int) and edge.chunk <= PER_TOKEN_CHUNK
        nodes = {node_of(d) for d in where[edge.src] + where[edge.dst]}
        if small and len(nodes) > 1:
            warnings.append(
                f"{edge.name} streams per token across nodes ({' vs '.join(sorted(nodes))}): no "
                "node had room for both ends; each token crosses the network"
            )
    graph.meta["warnings"] = tuple(warnings)


def place(graph: Graph, target: Target) -> Graph:
    graph = graph.copy()
    placer = _Placer(graph, target)
    groups = sorted(
        _groups(graph),
        key=lambda g: (not any(n.device for n in g), -sum(n.meta["cost"].need for n in g)),
    )
    for group in groups:
        placer.place_group(group)
    placer.budgets()
    _warn_streams_across_nodes(graph, placer.where)
    for node in graph.stages:
        node.meta["placement"] = Placement(
            tuple(placer.where[node.name]),
            placer.budget[node.name],
            tuple(placer.placed[node.name]),
            placer.need[node.name],
        )
    # The cluster manager's id of each device's node, for a transport that pins executors.
    node_ids = {d.name: d.node_id for d in target.devices if d.node_id}
    graph.meta["devices"] = tuple(placer.use(d, node_ids.get(d, "")) for d in placer.capacity)
    return graph
