"""Pass: type/shape inference. Every output port gets `meta["out"][port] = PortSpec`, and every
edge `meta["item"]`: the dtype and shape of one streamed step after the edge's adapter and
map chain, and `meta["max_steps"]`: how many steps one request may send on it.

Dims come from the stage's model config and its parameters at their default values; a
request that overrides a size-changing parameter beyond its default is checked at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

from omniflow.adapters import ADAPTERS
from omniflow.errors import GraphError
from omniflow.ir.graph import INPUT, INPUT_PORT, Graph, Node
from omniflow.ir.kinds import KINDS, stage_ports
from omniflow.ir.types import TensorSpec
from omniflow.ir.values import Ref, resolve
from omniflow.kernels.pointwise_ops import chain_out_dtype
from omniflow.passes.pipeline import Target

# UTF-8 bytes one text step may carry: a long token plus characters held back (an
# incomplete UTF-8 sequence, a possible stop string) from earlier steps.
TEXT_BYTES_PER_TOKEN = 64


@dataclass(frozen=True)
class PortSpec:
    step: TensorSpec  # one step of the stream (the whole value for one-shot stages)
    max_steps: int

    def __str__(self) -> str:
        return f"{self.step} x{self.max_steps}"


# What a request may send on an input, and what a python stage emits per step, by type.
DEFAULT_SPECS: dict[str, PortSpec] = {
    "text": PortSpec(TensorSpec("utf8", (64 * 1024,)), 1),
    "chat": PortSpec(TensorSpec("utf8", (256 * 1024,)), 1),
    "tokens": PortSpec(TensorSpec("int64", (8192,)), 1),
    "hidden": PortSpec(TensorSpec("float32", (1, 1024)), 4096),
    "codes": PortSpec(TensorSpec("int64", (16,)), 4096),
    "latents": PortSpec(TensorSpec("float32", (16, 128, 128)), 1),
    "image": PortSpec(TensorSpec("uint8", (1024, 1024, 3)), 1),
    "audio": PortSpec(TensorSpec("float32", (24000 * 60,)), 1),
    "video": PortSpec(TensorSpec("uint8", (81, 480, 832, 3)), 1),
    "kv": PortSpec(TensorSpec("bfloat16", (1, 2, 8, 128)), 4096),
}


def param_value(graph: Graph, node: Node, key: str):
    """A stage parameter's value with pipeline parameters at their defaults."""
    return resolve(node.params.get(key, KINDS[node.op].params[key].default), graph.params)


def stage_dtype(graph: Graph, node: Node) -> str:
    """The dtype the program asks for, else the model's own (token2wav runs in float32)."""
    return (
        param_value(graph, node, "dtype") if "dtype" in node.params else node.meta["config"].dtype
    )


def _stage_spec(graph: Graph, node: Node, port: str) -> PortSpec:
    cfg = node.meta["config"]
    dtype = stage_dtype(graph, node)
    value = lambda key: param_value(graph, node, key)  # noqa: E731
    if node.op == "ar":
        max_tokens = value("max_tokens")
        cfgd = cfg.config
        layers, kv_heads = (
            cfgd["num_hidden_layers"],
            cfgd.get("num_key_value_heads", cfgd["num_attention_heads"]),
        )
        head_dim = cfgd.get("head_dim") or cfg.hidden_size // cfgd["num_attention_heads"]
        if port == "hidden" and (needs := _adapter_needs(graph, node)) is not None:
            rows, with_prompt = needs
            steps = max_tokens + (value("max_len") if with_prompt else 0)
            return PortSpec(TensorSpec(dtype, (rows, cfg.hidden_size)), steps)
        return {
            "text": PortSpec(TensorSpec("utf8", (TEXT_BYTES_PER_TOKEN,)), max_tokens),
            "tokens": PortSpec(TensorSpec("int64", (1,)), max_tokens),
            "hidden": PortSpec(TensorSpec(dtype, (1, cfg.hidden_size)), max_tokens),
            "codes": PortSpec(TensorSpec("int64", (cfg.num_codebooks,)), max_tokens),
            "kv": PortSpec(TensorSpec(dtype, (layers, 2, kv_heads, head_dim)), value("max_len")),
        }[port]
    if node.op == "encoder":
        # Each step is one prompt's embeddings after a length header position; a stage on a
        # guidance path sends two steps (the prompt and its companion).
        steps = 2 if node.name in cfg_path(graph) else 1
        return PortSpec(TensorSpec(dtype, (1 + value("max_len"), cfg.hidden_size)), steps)
    if node.op == "diffusion":
        scale = cfg.vae_scale_factor
        shape = (cfg.latent_channels, value("height") // scale, value("width") // scale)
        frames = value("frames")
        return PortSpec(TensorSpec("float32", ((frames,) if frames > 1 else ()) + shape), 1)
    if node.op == "vae":
        producer = next(e for e in graph.in_edges(node.name) if e.dst_port == "latents")
        *frames, _, h, w = producer.meta["item"].shape
        scale = cfg.vae_scale_factor
        return PortSpec(TensorSpec("float32", (*frames, h * scale, w * scale, 3)), 1)
    if node.op == "vocoder":
        return PortSpec(TensorSpec("float32", (cfg.samples_per_frame,)), value("max_len"))
    raise GraphError(f"no shape rule for {node.op}.{port}", node.span)


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


def _adapter_needs(graph: Graph, node: Node) -> tuple[int, bool] | None:
    """(rows, with_prompt) that the adapters on a stage's `hidden` edges ask it to send."""
    specs = {
        ADAPTERS[e.adapter]
        for e in graph.out_edges(node.name)
        if e.src_port == "hidden" and e.adapter in ADAPTERS
    }
    needs = {(s.source_rows, s.with_prompt) for s in specs} - {(1, False)}
    if len(needs) > 1:
        raise GraphError(f"adapters on {node.name}.hidden ask for different items", node.span)
    return next(iter(needs), None)


def _out_spec(graph: Graph, node: Node, port: str) -> PortSpec:
    if node.op == INPUT:
        return DEFAULT_SPECS[node.params["type"]]
    if node.op == "python":
        return DEFAULT_SPECS[stage_ports("python", node.params)[1][port]]
    return _stage_spec(graph, node, port)


def infer_types(graph: Graph, target: Target) -> Graph:
    graph = graph.copy()
    for node in graph.topo_order():
        outs = {INPUT_PORT: None} if node.op == INPUT else node.ports()[1]
        node.meta["out"] = {
            port: _out_spec(graph, node, port) for port in outs if node.op != "output"
        }
        for edge in graph.out_edges(node.name):
            spec = node.meta["out"][edge.src_port]
            step = spec.step
            if edge.maps:
                ops = [(op.name, op.args) for op in edge.maps]
                step = TensorSpec(chain_out_dtype(step.dtype, ops), step.shape)
            edge.meta["item"] = step
            edge.meta["max_steps"] = spec.max_steps
    return graph
