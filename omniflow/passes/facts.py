"""What the passes write into the IR: one frozen dataclass per fact, under one `meta` key.

Each pass module says which facts it reads (`READS`) and writes (`WRITES`), by key; the
pipeline (`pipeline.py`) refuses a pass that writes a key it did not declare, and `lower`
builds the plan from these types alone. A fact is replaced, never mutated (`dataclasses.
replace`), since copies of a graph share their facts. Each prints as one short phrase: `str(graph)`
(the IR printer) shows a node's and an edge's facts on its line, the graph's after them.

| key | on | fact | written by |
| --- | --- | --- | --- |
| `model` | model stages | `ModelFacts` | resolve_models |
| `ports` | inputs, stages | `PortFacts` | infer_types |
| `attrs` | outputs | `OutputFacts` | infer_types |
| `item` | edges | `EdgeItem` | infer_types |
| `cost` | stages | `CostFacts` | estimate_costs |
| `placement` | stages | `Placement` | place (plan_buffers takes device rings out of budgets) |
| `devices` | the graph | `tuple[DeviceUse, ...]` | place |
| `executor` | every node | `str`, its executor's name | fuse_stages |
| `executors` | the graph | `tuple[ExecutorGroup, ...]` | fuse_stages |
| `pointwise` | edges with maps | `PointwiseKernel` | fuse_pointwise |
| `schedule` | edges | `tuple[int, ...] | None` (None: whole output) | size_chunks |
| `carries_state` | edges | `bool`: its consumer carries each stream's state (no context) | size_chunks |
| `plays_s` | edges | `float | None`: seconds of audio a step plays for (carried-state edges) | size_chunks |
| `channel` | edges | `Channel` | plan_buffers |
| `shm_bytes` | the graph | `int` | plan_buffers |
| `warnings` | the graph | `tuple[str, ...]` | place, size_chunks, plan_buffers |
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omniflow.catalog.components import ComponentConfig
from omniflow.catalog.costs import StageCost
from omniflow.devices import human_bytes
from omniflow.ir.types import TensorSpec


@dataclass(frozen=True)
class ModelFacts:
    """A model stage's component config, the VAE its denoiser encodes an input image with
    (an edit pipeline's; None otherwise), and the other experts a two-expert DiT loads."""

    config: ComponentConfig
    image_encoder: ComponentConfig | None = None
    # Other transformers the stage loads beside `config`'s and runs at other steps (a
    # two-expert DiT's, which its config names under `experts`).
    experts: tuple[ComponentConfig, ...] = ()

    def __str__(self) -> str:
        text = f"{_component(self.config)} {self.config.dtype}"
        if self.image_encoder is not None:
            text += f", image encoder {_component(self.image_encoder)}"
        if self.experts:
            text += ", experts " + ", ".join(map(_component, self.experts))
        return text


def _component(config: ComponentConfig) -> str:
    return config.model + (f"/{config.component}" if config.component else "")


@dataclass(frozen=True)
class PortSteps:
    """What one request sends on an output port: steps of one spec, at most `max_steps`."""

    step: TensorSpec  # one step of the stream (the whole value for one-shot stages)
    max_steps: int

    def __str__(self) -> str:
        return f"{self.step} x{self.max_steps}"


@dataclass(frozen=True)
class PortFacts:
    """A node's output ports, each with what one request sends on it."""

    out: dict[str, PortSteps] = field(hash=False)

    def __str__(self) -> str:
        return ", ".join(f"{port} {steps}" for port, steps in self.out.items())


@dataclass(frozen=True)
class OutputFacts:
    """What the compiler derives of a pipeline output beyond its type (an audio output's
    `rate`, from its vocoder's config)."""

    attrs: dict = field(hash=False)

    def __str__(self) -> str:
        return ", ".join(f"{key} {value}" for key, value in self.attrs.items())


@dataclass(frozen=True)
class EdgeItem:
    """One step on an edge after its adapter and map chain, and how many a request sends."""

    item: TensorSpec
    max_steps: int

    def __str__(self) -> str:
        return f"{self.item} x{self.max_steps}"


@dataclass(frozen=True)
class CostFacts:
    """A stage's estimate at its effective batch (doubled on the path of a classifier-free
    guidance companion, `cfg_input`), and the bytes its budget must cover (`need`: the
    estimate's total, or the program's explicit `memory=`). `cost` is None for python stages.
    `cache_positions`: what one request's KV cache holds in an `ar` stage, which its cost
    counts (0 elsewhere)."""

    cost: StageCost | None
    need: int
    batch: int = 1
    cfg_input: str | None = None
    cache_positions: int = 0

    def __str__(self) -> str:
        text = f"needs {human_bytes(self.need)} at batch {self.batch}"
        if self.cost is not None:
            text += (f" (weights {human_bytes(self.cost.weight_bytes)}, kv "
                     f"{human_bytes(self.cost.kv_cache_bytes)}, activations "
                     f"{human_bytes(self.cost.activation_bytes)})")  # fmt: skip
        return text + (f", guidance from {self.cfg_input}" if self.cfg_input else "")


@dataclass(frozen=True)
class Placement:
    """Where a stage runs: its devices (the first is `device`), its memory budget, per
    device why it went there, and what of the budget its load needs (`need`: its estimate,
    and on a GPU its stream's library workspace; the rest is its share of the slack)."""

    devices: tuple[str, ...]
    budget: int
    placed: tuple[str, ...] = ()
    need: int = 0

    @property
    def device(self) -> str:
        return self.devices[0]

    def __str__(self) -> str:
        return f"{', '.join(self.devices)}, budget {human_bytes(self.budget)}"


@dataclass(frozen=True)
class DeviceUse:
    """A device of the target: bytes placed on it (its stages' needs and its executor
    processes' CUDA contexts), bytes usable, its cluster node's id; the contexts (one per
    executor process on a GPU: the one its stages share, one more per isolated stage; none
    off GPUs), the bytes charged for each, and its total: its stages' budgets plus its
    contexts, what the plan expects the device to hold at most."""

    name: str
    used: int
    usable: int
    node_id: str = ""
    contexts: int = 0
    context_bytes: int = 0
    total: int = 0

    def __str__(self) -> str:
        return (
            f"{self.name}: {human_bytes(self.used)} of {human_bytes(self.usable)}, "
            f"CUDA contexts {self.contexts} x {human_bytes(self.context_bytes)}, "
            f"total {human_bytes(self.total)}"
        )


@dataclass(frozen=True)
class ExecutorGroup:
    """One executor: its stages (in topological order), devices, why its boundaries are
    where they are, and on a GPU each stage's CUDA stream priority (`priorities[i]` is
    `stages[i]`'s, lower runs first; empty off GPUs, where stages share the one stream)."""

    name: str
    devices: tuple[str, ...]
    stages: tuple[str, ...]
    reasons: tuple[str, ...] = ()
    priorities: tuple[int, ...] = ()

    def __str__(self) -> str:
        where = f" on {', '.join(self.devices)}" if self.devices else ""
        why = f" ({'; '.join(self.reasons)})" if self.reasons else ""
        stages = self.stages
        if self.priorities:
            pairs = zip(self.stages, self.priorities, strict=True)
            stages = [f"{stage} (stream priority {p})" for stage, p in pairs]
        return f"{self.name}{where}: {', '.join(stages)}{why}"


@dataclass(frozen=True)
class PointwiseKernel:
    """An edge's map chain as one fused kernel (its ops as (name, args)), and the executor
    that runs it."""

    kernel: str
    ops: tuple[tuple[str, tuple], ...]
    in_dtype: str
    out_dtype: str
    runs_in: str

    def __str__(self) -> str:
        return f"{self.kernel} {self.in_dtype}->{self.out_dtype} in {self.runs_in}"


@dataclass(frozen=True)
class Channel:
    """How an edge moves its chunks (`local`, `shm`, `cuda-ipc`, `p2p`, `net`) and its
    pre-allocated ring: slots of `slot_bytes`, `credits` per request, in `device`'s memory
    ("" for a host ring)."""

    kind: str
    slots: int = 0
    slot_bytes: int = 0
    credits: int = 0
    device: str = ""

    @property
    def ring_bytes(self) -> int:
        return self.slots * self.slot_bytes

    def __str__(self) -> str:
        if not self.slots:  # a local hand-off: a reference, no ring
            return self.kind
        text = (f"{self.kind} ring {self.slots} x {human_bytes(self.slot_bytes)} = "
                f"{human_bytes(self.ring_bytes)}, {self.credits} credits")  # fmt: skip
        return text + (f", on {self.device}" if self.device else "")
