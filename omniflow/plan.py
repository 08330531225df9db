"""The `Plan`: what the compiler hands the runtime (made by `omniflow.lower`).

A plan is plain data, versioned and JSON-serializable. Besides the pipeline's stages and
channels (which the reference interpreter and the printed tables read) it holds one
self-contained `Program` per executor, the frontend's included: the stages it runs with
their load-time settings resolved, the channels it reads and writes with their chunk
schedules, adapters, map chains and ring sizes. An executor is handed its program and
nothing else. Per-request values stay symbolic in a stage's `params` (`Param`, `StageSeed`,
`InputRef` from `omniflow.ir.values`, tagged objects in JSON) until a request is admitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from omniflow.errors import OmniflowError
from omniflow.ir.values import PlanValue

# 4: stages name their model family and its code (`StagePlan.family`); channels name their
# adapter's code; every setting a backend reads is in the stage's settings; devices and
# pointwise kernels are structs.
# 5: the stages of a GPU share its executor, each on a CUDA stream of the priority its
# program gives (`Program.stream_priorities`).
# 6: an `ar` stage carries its KV cache's positions a request (`StagePlan.cache_positions`),
# which its backend sizes the static cache by (a version-5 plan has none).
PLAN_VERSION = 6
# The program that holds the pipeline's inputs and outputs: the engine's own.
FRONTEND = "frontend"


@dataclass
class FamilyCode:
    """What the stage's model family gives its backend, as dotted paths ("module:name") an
    executor imports when it loads the stage: `name` the family, `code` its code by backend
    name (what each is called with is that backend's contract: docs/backends.md),
    `speakers` the reader of a checkpoint's speakers, `admission` the family's checks of a
    request against its checkpoint, `media_tokens` its count of a request's media,
    `voices` its encoder of reference clips into voice prompts ("" where it has none:
    docs/models.md, "Adding a model family");
    `prompt_inputs` the input ports beside `prompt` whose text the stage puts into its
    prompt (admission counts them against its length)."""

    name: str
    code: dict[str, str] = field(default_factory=dict)
    speakers: str = ""
    admission: str = ""
    media_tokens: str = ""
    voices: str = ""
    prompt_inputs: list[str] = field(default_factory=list)


@dataclass
class StagePlan:
    """One stage. `params`: the per-request template (its references resolve at admission);
    `settings`: what its backend loads with, every parameter of its kind resolved to its
    compiled value (the program's, else the kind's default); `cache_positions`: what one
    request's KV cache holds in an `ar` stage, as its cost counted it (its prompt up to
    `max_len`, the rows its family adds to a prompt built from another stage's, and
    `max_tokens`); `family`: its model's family (None: no family knows the model, or the
    stage runs none)."""

    name: str
    kind: str
    executor: str
    devices: list[str]
    params: dict[str, PlanValue]
    model: str | None
    component: str | None
    budget_bytes: int
    need_bytes: int
    weight_bytes: int = 0
    kv_cache_bytes: int = 0
    activation_bytes: int = 0
    flops_per_item: float = 0.0
    batch: int = 1
    settings: dict = field(default_factory=dict)
    cache_positions: int = 0
    placed: list[str] = field(default_factory=list)  # per replica: "device: why there"
    family: FamilyCode | None = None


@dataclass
class PointwisePlan:
    """An edge's map chain as one fused kernel: its ops (`ops[i]` is `[name, args]`), dtypes
    in and out, and the program that runs it."""

    kernel: str
    ops: list[tuple[str, list]]
    in_dtype: str
    out_dtype: str
    runs_in: str


@dataclass
class ChannelPlan:
    name: str
    src: str
    src_port: str
    dst: str
    dst_port: str
    type: str
    kind: str  # "local", "shm", "cuda-ipc", "p2p" or "net" (passes/plan_buffers.py)
    src_executor: str
    dst_executor: str
    item_dtype: str
    item_shape: list[int]
    max_steps: int
    schedule: list[int] | None  # None: the whole output in one message
    context: int = 0
    # The consumer carries each stream's state from chunk to chunk: it needs no context.
    carries_state: bool = False
    adapter: str | None = None
    adapter_impl: str | None = None  # "module:factory" of a named adapter (a user's: None)
    maps: list[str] = field(default_factory=list)
    pointwise: PointwisePlan | None = None
    slots: int = 0
    slot_bytes: int = 0
    ring_bytes: int = 0
    credits: int = 0
    device: str = ""  # the GPU whose memory holds a cuda-ipc or p2p ring ("" for host rings)
    # Seconds of audio one step plays for, where the edge streams into a vocoder that
    # carries its state (None: not known): the writer paces its chunks by the listener's
    # slack, and the producer orders its requests by it (runtime/slack.py).
    plays_s: float | None = None


@dataclass
class Program:
    """What one executor runs: its stages in topological order, the channels it reads from
    other programs (`inbound`: it creates their rings), writes to them (`outbound`: it
    attaches to theirs) and passes between its own stages or ports (`local`), why the
    compiler formed it (`reasons`), and on a GPU the priority of each stage's CUDA stream
    (`stream_priorities`, stage -> priority, lower runs first; empty: the program runs its
    stages on the device's one stream, as on a CPU)."""

    name: str
    devices: list[str]
    stages: list[StagePlan]
    inbound: list[ChannelPlan]
    outbound: list[ChannelPlan]
    local: list[ChannelPlan]
    reasons: list[str] = field(default_factory=list)
    stream_priorities: dict[str, int] = field(default_factory=dict)

    @property
    def stage_names(self) -> list[str]:
        return [s.name for s in self.stages]

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> Program:
        return msgspec.json.decode(text, type=cls)


@dataclass
class PortPlan:
    name: str
    type: str
    default: object = None
    attrs: dict = field(default_factory=dict)
    # An input a request may leave out (`input x: type?`): its edges then end empty.
    optional: bool = False


@dataclass
class ParamLimit:
    """The numbers a request may give a pipeline parameter: `low <= value <= high` (None:
    unbounded); `why` says where `high` comes from when the plan was compiled for it;
    `knobs` the sampling knobs (`omniflow.sampling`) whose domains it must be in."""

    low: int | float | None
    high: int | float | None
    why: str = ""
    knobs: list[str] = field(default_factory=list)


@dataclass
class DevicePlan:
    """A device the plan was compiled for: bytes its stages and rings use, bytes usable, and
    its cluster node's id ("" off a cluster); the CUDA contexts of the executor processes
    on it (`contexts`, each charged `context_bytes`; none off GPUs) and its total: its
    stages' budgets plus those contexts, what it is planned to hold at most."""

    name: str
    used_bytes: int
    usable_bytes: int
    node_id: str = ""
    contexts: int = 0
    context_bytes: int = 0
    total_bytes: int = 0


@dataclass
class Plan:
    version: int
    pipeline: str
    model: str | None
    params: dict
    devices: list[DevicePlan]
    programs: list[Program]
    stages: list[StagePlan]
    inputs: list[PortPlan]
    outputs: list[PortPlan]
    channels: list[ChannelPlan]
    shm_bytes: int = 0  # host rings (shm and net)
    device_ring_bytes: int = 0  # rings in GPU memory (cuda-ipc and p2p)
    limits: dict[str, ParamLimit] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    pass_seconds: dict = field(default_factory=dict)

    def to_json(self, indent: int = 2) -> str:
        return msgspec.json.format(msgspec.json.encode(self).decode(), indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        try:
            plan = msgspec.json.decode(text, type=cls)
        except msgspec.DecodeError as err:
            raise OmniflowError(f"not a valid plan: {err}") from err
        if plan.version != PLAN_VERSION:
            raise OmniflowError(
                f"plan version {plan.version} is not supported (this omniflow reads {PLAN_VERSION})"
            )
        return plan

    @property
    def executors(self) -> list[Program]:
        """The programs that run in executors: every one but the frontend's."""
        return [p for p in self.programs if p.name != FRONTEND]

    def program(self, name: str) -> Program:
        return next(p for p in self.programs if p.name == name)

    def stage(self, name: str) -> StagePlan:
        return next(s for s in self.stages if s.name == name)

    def upstream(self, outputs: frozenset[str]) -> frozenset[str]:
        """The stages a request for only `outputs` runs: those any of them depends on."""
        stages = {s.name for s in self.stages}
        found: set[str] = set()
        todo = [c.src for c in self.channels if c.dst in outputs]
        while todo:
            name = todo.pop()
            if name in stages and name not in found:
                found.add(name)
                todo += [c.src for c in self.channels if c.dst == name]
        return frozenset(found)
