"""Pass: type/shape inference. Every node's output ports get `meta["ports"]` (`PortFacts`:
a `PortSteps` per port), and every edge `meta["item"]` (`EdgeItem`): the dtype and shape of
one streamed step after the edge's adapter and map chain, and how many steps one request may
send on it. Every pipeline output gets `meta["attrs"]` (`OutputFacts`), the attributes the
compiler derives for it: an audio output a vocoder makes, the vocoder's sample rate
(`rate`), which a `rate=` in the program must match; a video output, the frame rate its
program gives (`fps`), which its MP4s are written at.

Dims come from the stage's model config and its parameters at their default values; a
request that overrides a size-changing parameter beyond its default is checked at run time.
An edit pipeline's text encoder also keeps the input image's tokens in its output, as many
as the catalog says its pipeline can make (`condition_image_tokens`); a stage whose model
conditions on no image cannot take one.
"""

from __future__ import annotations

from omniflow import families
from omniflow.errors import GraphError
from omniflow.ir.graph import INPUT, INPUT_PORT, OUTPUT, Graph, Node
from omniflow.ir.kinds import stage_ports
from omniflow.ir.types import TensorSpec
from omniflow.ir.values import resolve
from omniflow.kernels.pointwise_ops import chain_out_dtype
from omniflow.passes.common import Target, cfg_path, condition_image_tokens, stage_dtype
from omniflow.passes.facts import EdgeItem, OutputFacts, PortFacts, PortSteps

READS = ("model",)
WRITES = ("ports", "item", "attrs")

# UTF-8 bytes one text step may carry: a long token plus characters held back (an
# incomplete UTF-8 sequence, a possible stop string) from earlier steps.
TEXT_BYTES_PER_TOKEN = 64


# What a request may send on an input, and what a python stage emits per step, by type.
DEFAULT_SPECS: dict[str, PortSteps] = {
    "text": PortSteps(TensorSpec("utf8", (64 * 1024,)), 1),
    "chat": PortSteps(TensorSpec("utf8", (256 * 1024,)), 1),
    "tokens": PortSteps(TensorSpec("int64", (8192,)), 1),
    "hidden": PortSteps(TensorSpec("float32", (1, 1024)), 4096),
    "codes": PortSteps(TensorSpec("int64", (16,)), 4096),
    "latents": PortSteps(TensorSpec("float32", (16, 128, 128)), 1),
    "image": PortSteps(TensorSpec("uint8", (1024, 1024, 3)), 1),
    "audio": PortSteps(TensorSpec("float32", (24000 * 60,)), 1),
    "video": PortSteps(TensorSpec("uint8", (81, 480, 832, 3)), 1),
    "kv": PortSteps(TensorSpec("bfloat16", (1, 2, 8, 128)), 4096),
}
# A request's video input is a video file's bytes (the stage decodes and samples it): at
# most 16 MiB.
INPUT_SPECS: dict[str, PortSteps] = {
    **DEFAULT_SPECS,
    "video": PortSteps(TensorSpec("uint8", (16 * 1024 * 1024,)), 1),
}


def _stage_spec(graph: Graph, node: Node, port: str) -> PortSteps:
    cfg = node.meta["model"].config
    dtype = stage_dtype(graph, node)
    value = lambda key: graph.param_value(node, key)  # noqa: E731
    if node.op == "ar":
        max_tokens = value("max_tokens")
        if port == "hidden" and (needs := _adapter_needs(graph, node)) is not None:
            rows, with_prompt = needs
            steps = max_tokens + (value("max_len") if with_prompt else 0)
            return PortSteps(TensorSpec(dtype, (rows, cfg.hidden_size)), steps)
        return {
            "text": PortSteps(TensorSpec("utf8", (TEXT_BYTES_PER_TOKEN,)), max_tokens),
            "tokens": PortSteps(TensorSpec("int64", (1,)), max_tokens),
            "hidden": PortSteps(TensorSpec(dtype, (1, cfg.hidden_size)), max_tokens),
            "codes": PortSteps(TensorSpec("int64", (cfg.num_codebooks,)), max_tokens),
        }[port]
    if node.op == "encoder":
        # Each step is one prompt's embeddings after a length header position (an edit
        # pipeline's text encoder keeps the input image's tokens among them); a stage on a
        # guidance path sends two steps (the prompt and its companion).
        steps = 2 if node.name in cfg_path(graph) else 1
        rows = 1 + condition_image_tokens(graph, node) + value("max_len")
        return PortSteps(TensorSpec(dtype, (rows, cfg.hidden_size)), steps)
    if node.op == "diffusion":
        condition_image_tokens(graph, node)  # an image input needs a DiT conditioned on one
        scale = cfg.vae_scale_factor
        frames = value("frames")
        # A video's latents: channels, then latent frames (the VAE's temporal compression).
        shape = (value("height") // scale, value("width") // scale)
        if frames > 1:
            shape = (cfg.latent_frames(frames), *shape)
        return PortSteps(TensorSpec("float32", (cfg.latent_channels, *shape)), 1)
    if node.op == "vae":
        producer = next(e for e in graph.in_edges(node.name) if e.dst_port == "latents")
        _, *frames, h, w = producer.meta["item"].item.shape
        scale = cfg.vae_scale_factor
        wired = any(e.src_port == port for e in graph.out_edges(node.name))
        if wired and (port == "video") != bool(frames):
            what = "a video's latents" if frames else "an image's latents"
            raise GraphError(
                f"stage '{node.name}': its latents are {what}; take its "
                f"{'video' if frames else 'image'} output, not {port}",
                node.span,
            )
        if frames:  # the first latent frame is one video frame, each other `t` frames
            frames = [(frames[0] - 1) * cfg.vae_temporal_factor + 1]
        return PortSteps(TensorSpec("float32", (*frames, h * scale, w * scale, 3)), 1)
    if node.op == "vocoder":
        return PortSteps(TensorSpec("float32", (cfg.samples_per_frame,)), value("max_len"))
    raise GraphError(f"no shape rule for {node.op}.{port}", node.span)


def _adapter_needs(graph: Graph, node: Node) -> tuple[int, bool] | None:
    """(rows, with_prompt) that the adapters on a stage's `hidden` edges ask it to send."""
    known = families.adapters()
    specs = {
        known[e.adapter]
        for e in graph.out_edges(node.name)
        if e.src_port == "hidden" and e.adapter in known
    }
    needs = {(s.source_rows, s.with_prompt) for s in specs} - {(1, False)}
    if len(needs) > 1:
        raise GraphError(f"adapters on {node.name}.hidden ask for different items", node.span)
    return next(iter(needs), None)


def _out_spec(graph: Graph, node: Node, port: str) -> PortSteps:
    if node.op == INPUT:
        return INPUT_SPECS[node.params["type"]]
    if node.op == "python":
        return DEFAULT_SPECS[stage_ports("python", node.params)[1][port]]
    added = families.extra_outputs(node.op)
    if port in added and port not in stage_ports(node.op, node.params)[1]:
        return DEFAULT_SPECS[added[port]]  # a model family's own output: one value a request
    return _stage_spec(graph, node, port)


def _output_attrs(graph: Graph, output: Node) -> dict:
    """What the compiler knows of an output beyond its type: the sample rate of audio that
    a vocoder makes, from its model config. A `rate=` the program writes must agree."""
    (edge,) = graph.in_edges(output.name)
    producer = graph.node(edge.src)
    if edge.type == "video":  # the frame rate its MP4 is written at
        fps = resolve(output.params.get("fps"), graph.params)
        if fps is not None and (not isinstance(fps, int) or fps < 1):
            raise GraphError(f"output '{output.name}': fps must be a positive integer", output.span)
        return {} if fps is None else {"fps": fps}
    if edge.type != "audio" or producer.op != "vocoder":
        return {}
    cfg = producer.meta["model"].config
    rate = cfg.sample_rate
    if rate is None:
        return {}
    written = resolve(output.params.get("rate"), graph.params)
    if written is not None and written != rate:
        raise GraphError(
            f"output '{output.name}' says rate={written}, but stage '{producer.name}' "
            f"({cfg.model} [{cfg.component}]) makes {rate} Hz audio",
            output.span,
            f"leave rate= out (the compiler takes it from the vocoder) or write rate={rate}",
        )
    return {"rate": rate}


def infer_types(graph: Graph, target: Target) -> Graph:
    graph = graph.copy()
    for node in graph.topo_order():
        if node.op == OUTPUT:
            node.meta["attrs"] = OutputFacts(_output_attrs(graph, node))
            continue
        outs = {INPUT_PORT: None} if node.op == INPUT else node.ports()[1]
        node.meta["ports"] = PortFacts({port: _out_spec(graph, node, port) for port in outs})
        for edge in graph.out_edges(node.name):
            spec = node.meta["ports"].out[edge.src_port]
            step = spec.step
            if edge.maps:
                ops = [(op.name, op.args) for op in edge.maps]
                step = TensorSpec(chain_out_dtype(step.dtype, ops), step.shape)
            edge.meta["item"] = EdgeItem(step, spec.max_steps)
    return graph
