"""Real-size random-weight checkpoints, for measuring on a GPU without weights: what every
model family's builder shares, and the cache they are built into.

A family's builder (its descriptor's `scaled`, by real model id) writes the published
configuration (every width, head count and vocabulary size of the builtin catalog's copy)
on its tiny recipe's tokenizer and special ids, with each stack's layer count multiplied
by `depth` (1.0 = the real model), initialised on a device in bf16 the way transformers and
diffusers initialise an untrained model, and saved with `save_pretrained`: the result loads
through exactly the path a real checkpoint does. `MANIFEST`, written last, marks a
finished build; `scaled_checkpoint(model, depth)` builds one once into the cache.

Random weights would end text and speech at random points, so the builders zero the output
heads' rows of every id that ends or pads (and of ids the next stage cannot take): a
request then runs to its token limits, and every system measured on the checkpoint does
the same work.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import Any

import torch

from omniflow import families
from omniflow.errors import ModelConfigError
from omniflow.hf_logging import quiet
from omniflow.runtime.python_backend import import_function

# Written last: a directory without it is an interrupted build.
MANIFEST = "omniflow_scaled.json"
# Multimodal RoPE of a 128-dim head: 64 frequency pairs over (time, height, width).
REAL_MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}
_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "embedding_size",
    "d_model",
    "encoder_attention_heads",
    "encoder_ffn_dim",
    "output_dim",
    "num_heads",
    "out_hidden_size",
    "ff_mult",
    "emb_dim",
    "num_embeds",
    "upsample_initial_channel",
    "resblock_kernel_sizes",
    "resblock_dilation_sizes",
    "upsample_rates",
    "upsample_kernel_sizes",
)
# Set by the tiny recipe, left at the class defaults by the real config: the speaker encoder.
_DEFAULTED = (
    "enc_emb_dim",
    "enc_dim",
    "enc_channels",
    "enc_attention_channels",
    "enc_se_channels",
)
_DEPTHS = ("num_hidden_layers", "encoder_layers", "depth")
# Layer indexes that must stay inside a scaled stack.
_INDEXES = ("fullatt_block_indexes", "look_ahead_layers", "look_backward_layers")


def check_depth(depth: float) -> None:
    if not 0 < depth <= 1:
        raise ModelConfigError(f"depth must be in (0, 1], not {depth}")


def scaled_layers(real: int, depth: float) -> int:
    return max(1, round(real * depth))


def scale_into(config: dict[str, Any], parts: dict[tuple[str, ...], dict], depth: float) -> None:
    """Give the sub-configs of a tiny recipe's `config` (a config's `to_dict()`) at each
    key path of `parts` the real config's widths and `depth` x its layers."""
    for path, source in parts.items():
        target = config
        for key in path:
            target = target[key]
        target.update(_scaled(source, depth))
        target.pop("layer_types", None)  # derived from the layer count again
        for key in _DEFAULTED:
            target.pop(key, None)
        if "rope_parameters" in target and "mrope_section" in target["rope_parameters"]:
            target["rope_parameters"] = dict(REAL_MROPE)
    config.pop("transformers_version", None)


def _scaled(source: dict[str, Any], depth: float) -> dict[str, Any]:
    out = {key: copy.deepcopy(source[key]) for key in _SIZES if key in source}
    for key in _DEPTHS:
        if key in source:
            out[key] = scaled_layers(source[key], depth)
            layers, real_layers = out[key], source[key]
    for key in _INDEXES:
        if key in source:
            out[key] = sorted(
                {min(layers - 1, round(i * layers / real_layers)) for i in source[key]}
            )
    return out


def scaled_checkpoint(
    model: str, depth: float, device: str = "cuda", out: str | Path | None = None
) -> Path:
    """The scaled checkpoint of the real `model` at `depth`, built on first use into `out`
    (default: under `$OMNIFLOW_CACHE/scaled/`) by its family's builder."""
    from omniflow.checkpoints.tiny import announce_build, cache_root

    builders = {m: path for f in families.families() for m, path in f.scaled.items()}
    if model not in builders:
        raise ModelConfigError(f"no scaled build of '{model}'; there are {', '.join(builders)}")
    if out is None:
        out = cache_root() / "scaled" / f"{model.replace('/', '--')}-{depth:g}"
    out = Path(out)
    if not (out / MANIFEST).exists():
        with announce_build(f"{model} at depth {depth:g}, random weights, on {device}", out):
            import_function(builders[model])(out, depth, device)
            (out / MANIFEST).write_text(json.dumps({"model": model, "depth": depth}))
    return out


@contextlib.contextmanager
def initialising_bf16_on(device: str):
    """Modules built inside are initialised in bf16 straight on `device` (a real-size model
    in fp32 on the host first would take twice its memory and minutes), quietly."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with quiet(), torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)
