"""Where a stage's model comes from: a hub id, a local directory, or `tiny:NAME` — one of
the built-in tiny random-weight checkpoints of the real architectures, built on first use.

`use_tiny_models(graph)` swaps every model the examples name for its tiny counterpart, so a
real pipeline runs on any machine, through the same loading code as the real weights.

`model_path` is the one place production code reaches the checkpoint builders
(`omniflow.checkpoints`): it imports them lazily, to build a `tiny:` model on first use.
Nothing else outside tests, benchmarks and the `omniflow models` command imports them.
"""

from __future__ import annotations

from omniflow.errors import ModelConfigError
from omniflow.ir.graph import Graph

TINY_SCHEME = "tiny:"

# Real model -> the tiny checkpoint with the same architecture and components.
TINY_COUNTERPARTS: dict[str, str] = {
    "Qwen/Qwen2.5-Omni-7B": "tiny:qwen2.5-omni",
    "Qwen/Qwen2.5-Omni-3B": "tiny:qwen2.5-omni",
    "Qwen/Qwen3-Omni-30B-A3B-Instruct": "tiny:qwen3-omni",
    "Qwen/Qwen2.5-VL-7B-Instruct": "tiny:qwen2.5-vl",
    "Qwen/Qwen2.5-VL-3B-Instruct": "tiny:qwen2.5-vl",
    "Qwen/Qwen-Image": "tiny:text-to-image",
    "Qwen/Qwen-Image-Edit": "tiny:image-edit",
    "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice": "tiny:tts",
    "Qwen/Qwen3-TTS-12Hz-1.7B-Base": "tiny:tts",
    "Qwen/Qwen2.5-0.5B-Instruct": "tiny:qwen2",
    "Qwen/Qwen2.5-7B-Instruct": "tiny:qwen2",
}


def model_path(model: str, progress: bool = False) -> str:
    """What `from_pretrained` should load for `model` (building a tiny checkpoint if needed)."""
    if model.startswith(TINY_SCHEME):
        from omniflow.checkpoints.tiny import TINY_MODELS, build_tiny

        name = model.removeprefix(TINY_SCHEME)
        if name not in TINY_MODELS:
            raise ModelConfigError(
                f"unknown tiny model '{name}'; built-in: {', '.join(TINY_MODELS)}"
            )
        return str(build_tiny(name, progress=progress))
    return model


def use_tiny_models(graph: Graph) -> Graph:
    """A copy of `graph` whose models are their tiny counterparts (unknown ones fail)."""

    def tiny(model: str) -> str:
        if model.startswith(TINY_SCHEME):
            return model
        if model not in TINY_COUNTERPARTS:
            known = ", ".join(TINY_COUNTERPARTS)
            raise ModelConfigError(
                f"no tiny counterpart of '{model}'; tiny versions exist for {known}"
            )
        return TINY_COUNTERPARTS[model]

    graph = graph.copy()
    if graph.model:
        graph.model = tiny(graph.model)
    for node in graph.stages:
        if isinstance(node.params.get("model"), str):
            node.params["model"] = tiny(node.params["model"])
    return graph
