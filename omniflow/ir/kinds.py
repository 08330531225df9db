"""Stage kinds: the ports each kind of stage has and the parameters it accepts.

This table is the single source the build phase checks programs against, the printer
lists in hints, and the backends implement.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from omniflow.dtypes import STAGE_DTYPES
from omniflow.ir.values import Auto, Param, Ref
from omniflow.sampling import KNOBS


@dataclass(frozen=True)
class ParamSpec:
    """A stage parameter: accepted Python types, default, and whether it must be given.

    `low`/`high` bound a number (inclusive). `planned`: the compiler sizes memory and buffers
    from this value, so a request may lower it but never raise it above what was compiled.
    `model_default`: left unset, the model's own default applies (its generation config's
    sampling defaults), not `default`, so lowering does not write `default` into the plan.
    `knob`: a sampling knob (`omniflow.sampling`) whose domain the value must be in, at
    compile time and at admission alike.
    """

    types: tuple[type, ...]
    default: object = None
    required: bool = False
    choices: tuple[object, ...] = ()
    low: float = -math.inf
    high: float = math.inf
    planned: bool = False
    model_default: bool = False
    knob: str = ""


@dataclass(frozen=True)
class StageKind:
    name: str
    doc: str
    inputs: dict[str, tuple[str, ...]]
    outputs: dict[str, str]
    params: dict[str, ParamSpec] = field(default_factory=dict)
    needs_model: bool = True
    # A request holds a row of the stage's batch from its first step to its last (a KV
    # cache, latents, a stream's context), so `max_batch` bounds the requests the pipeline
    # serves at once; a stage that passes each request once (an encoder, a VAE) does not.
    holds_requests: bool = True


_INT = (int,)
_FLOAT = (float, int)
_STR = (str,)


def number_text(value: float) -> str:
    """A bound as a message says it: whole numbers in full (2^20 as 1048576, a seed's
    2^63 - 1 whole, where `:g` writes 1.04858e+06 and 9.22337e+18), others as `:g` does."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


COMMON_PARAMS: dict[str, ParamSpec] = {
    "model": ParamSpec(_STR),
    "component": ParamSpec(_STR),
    "max_batch": ParamSpec(_INT, 8, low=1),
    # Unset: the checkpoint's own dtype (what the compiler sizes the stage with).
    "dtype": ParamSpec(_STR, choices=STAGE_DTYPES),
    "backend": ParamSpec(
        _STR, "auto", choices=("auto", "transformers", "diffusers", "vllm", "python")
    ),
    "memory": ParamSpec(_STR),  # an explicit budget such as "20GiB" overrides the estimate
    # A process of its own, though it shares a GPU: the stage's host work would hold the
    # interpreter lock the other stages' steps need (fuse_stages).
    "isolate": ParamSpec((bool,), False),
}

# A request's seed: what `random.getrandbits(63)` draws, so it fits every generator's seed.
# The diffusion stage's attention kernels (omniflow.backends.dit_blocks runs them).
DIT_ATTENTION = ("auto", "sdpa", "flash", "efficient", "cudnn", "math", "flash_attn")
SEED_BITS = 63
SEED = ParamSpec(_INT, low=0, high=(1 << SEED_BITS) - 1)
# The parameter every program has without declaring it: the request's seed.
SEED_PARAM = "seed"
# Bounds that keep the compiler's arithmetic finite for any program.
_LENGTH = {"low": 1, "high": 1 << 20, "planned": True}
# Prompt positions one prefill forward of an `ar` stage holds unless it says otherwise:
# batched prompts up to this many (padded), or one full-length prompt if that is longer.
PREFILL_TOKENS = 8192
_PIXELS = {"low": 16, "high": 16384, "planned": True}


def _knob(name: str, **spec) -> ParamSpec:
    """A sampling knob as a parameter: its domain is the knob's (`ParamSpec.knob`)."""
    knob = KNOBS[name]
    return ParamSpec(knob.types, knob.neutral, knob=name, **spec)


_SAMPLING = {
    "max_tokens": _knob("max_tokens", **_LENGTH),
    # Left unset, each of these is the model's generation config's, else the knob's neutral.
    **{
        name: _knob(name, model_default=True)
        for name in ("temperature", "top_p", "top_k", "repetition_penalty")
    },
    "seed": SEED,
    "stop": ParamSpec((list,)),
}


def _kind(
    name, doc, inputs, outputs, params=None, needs_model=True, holds_requests=True
) -> StageKind:
    params = {**COMMON_PARAMS, **(params or {})}
    return StageKind(name, doc, inputs, outputs, params, needs_model, holds_requests)


KINDS: dict[str, StageKind] = {
    k.name: k
    for k in (
        _kind(
            "ar",
            "autoregressive model: prefill then token-by-token decode with a KV cache",
            {"prompt": ("chat", "text", "tokens"), "embeds": ("hidden",), "voice": ("text",)},
            {"text": "text", "tokens": "tokens", "hidden": "hidden", "codes": "codes"},
            {
                **_SAMPLING,
                "max_len": ParamSpec(_INT, 4096, **_LENGTH),
                "speaker": ParamSpec(_STR),
                # How the transformers backend decodes: "graphs" (a static KV cache and
                # CUDA graphs captured at load), "static" (the same step, eager), "eager"
                # (a dynamic cache); "auto" is "graphs" on CUDA, "eager" on CPU.
                "decode": ParamSpec(_STR, "auto", choices=("auto", "graphs", "static", "eager")),
                # Prompt positions (padded to the longest) that one prefill forward batches
                # across new requests; a longer prompt is prefilled alone.
                "prefill_tokens": ParamSpec(_INT, PREFILL_TOKENS, low=1, high=1 << 20),
            },
        ),
        _kind(
            "encoder",
            "one forward pass from text, images, video or audio to hidden states",
            {
                "prompt": ("chat", "text", "tokens"),
                "image": ("image",),
                "video": ("video",),
                "audio": ("audio",),
            },
            {"hidden": "hidden"},
            {"max_len": ParamSpec(_INT, 1024, **_LENGTH)},
            holds_requests=False,
        ),
        _kind(
            "diffusion",
            "step-wise denoiser (prepare, denoise step, scheduler step) with optional guidance",
            {"cond": ("hidden",), "image": ("image",)},
            {"latents": "latents"},
            {
                "steps": ParamSpec(_INT, 50, low=1, high=1000),
                # The guidance scales are the model's own knobs, under its own names (its
                # family's `stage_params`: Qwen-Image's `true_cfg_scale`, Wan's
                # `guidance_scale`): the kind has no scale of its own.
                "cfg": ParamSpec((Ref,)),  # the input whose value is the unconditional companion
                "height": ParamSpec(_INT, 1024, **_PIXELS),
                "width": ParamSpec(_INT, 1024, **_PIXELS),
                # Frames of a video (1: an image); it is made with `video_frames` of them
                # (omniflow.catalog.components), whose latents hold (made - 1) / the VAE's
                # temporal scale + 1 latent frames.
                "frames": ParamSpec(_INT, 1, **_LENGTH),
                "seed": SEED,
                # Step caching (first-block cache, omniflow.backends.step_cache): a step
                # whose first transformer block's output moved less than this, relative to
                # the last computed step, reuses that step's residual of the other blocks.
                # 0: every step computed (bit-identical to no cache).
                "cache_threshold": ParamSpec(_FLOAT, 0.0, low=0, high=10),
                # Steps computed whatever the threshold, at the start of each request.
                "cache_warmup": ParamSpec(_INT, 2, low=0, high=1000),
                # At most this many steps in a row reused (0: no limit).
                "cache_max_reuse": ParamSpec(_INT, 0, low=0, high=1000),
                # The transformer's blocks: "fused" (the family's blocks on fused kernels,
                # `fused_blocks`: the same computation), "modules" (diffusers' own forward);
                # "auto" is "fused" on CUDA where the family has fused blocks. Set at load.
                "blocks": ParamSpec(_STR, "auto", choices=("auto", "fused", "modules")),
                # The fused blocks' attention kernel (omniflow.backends.dit_blocks): "auto"
                # times those that run here at load and keeps the fastest (CUDA; else "sdpa").
                "attention": ParamSpec(_STR, "auto", choices=DIT_ATTENTION),
            },
        ),
        _kind(
            "vae",
            "latent decoder to pixels: an image, or a video's frames",
            {"latents": ("latents",)},
            {"image": "image", "video": "video"},
            holds_requests=False,
        ),
        _kind(
            "vocoder",
            "codec frames to waveform, decoded in chunks with left context",
            {"codes": ("codes",), "hidden": ("hidden",)},
            {"audio": "audio"},
            {
                "max_len": ParamSpec(_INT, 4096, **_LENGTH),
                "speaker": ParamSpec(_STR),
                "seed": SEED,
                # Frames a window waits for after the frames it keeps; unset: the decoder's
                # reach, so the stream is its whole-utterance decode (token2wav: 24 codes, two
                # DiT blocks). Less is an earlier first packet for a small error (token2wav at
                # 12, Qwen's own streaming setting: ~1e-2).
                "lookahead": ParamSpec(_INT, low=0),
                # How the transformers backend decodes windows: "graphs" (static buffers for
                # the edge's grid of window lengths at each batch bucket, each one's decode
                # captured as a CUDA graph at load), "static" (the same buffers, eager),
                # "eager"; "auto" is "graphs" on CUDA for decoders with static windows
                # (token2wav), else "eager".
                "decode": ParamSpec(_STR, "auto", choices=("auto", "graphs", "static", "eager")),
                # Its arithmetic: "float32" (the model's own), "tf32" or "bfloat16" (token2wav's
                # DiT); "auto" is "bfloat16" on CUDA where the decoder runs it, else "float32".
                "precision": ParamSpec(
                    _STR, "auto", choices=("auto", "float32", "tf32", "bfloat16")
                ),
                # Whose window a step decodes first: "slack", the request whose listener runs
                # out of audio first; "arrival", the request that came first.
                "order": ParamSpec(_STR, "slack", choices=("slack", "arrival")),
            },
        ),
        _kind(
            "python",
            "a user function `f(batch) -> batch` (or a generator of chunks) given by dotted path",
            {},
            {},
            {
                "fn": ParamSpec((Ref, str), required=True),
                "inputs": ParamSpec(_STR, "in:tokens"),
                "outputs": ParamSpec(_STR, "out:tokens"),
            },
            needs_model=False,
        ),
    )
}


def requests_at_once(stages: Iterable[tuple[str, int]]) -> int:
    """How many requests a pipeline serves at once, from its stages' (kind, max_batch): the
    narrowest batch of the stages that hold their requests (`StageKind.holds_requests`; a
    request waits for a turn at the others), else of every stage."""
    stages = list(stages)
    held = [batch for kind, batch in stages if KINDS[kind].holds_requests]
    return max(1, min(held or [batch for _, batch in stages], default=1))


# What the language reserves but no backend runs yet, refused at build with why: parameters
# of every kind, and ports by (kind, port).
_ONE_COPY = "each stage runs as one copy on its devices"
NOT_YET_PARAMS: dict[str, str] = {
    "replicas": f"replicas are not supported yet: {_ONE_COPY}",
    "role": "splitting an ar stage into prefill and decode stages is not supported yet",
}
_MEDIA_IN = "an ar stage takes media as embeddings from an encoder stage (into `embeds`)"
NOT_YET_PORTS: dict[tuple[str, str], str] = {
    ("ar", "image"): f"ar stages take no image yet: {_MEDIA_IN}",
    ("ar", "audio"): f"ar stages take no audio yet: {_MEDIA_IN}",
    ("ar", "video"): f"ar stages take no video yet: {_MEDIA_IN}",
    ("ar", "kv"): "passing a KV cache between stages is not supported yet",
    ("diffusion", "kv"): "passing a KV cache between stages is not supported yet",
}

# Edge attributes a flow may carry; `rate` and `format` belong to an output instead.
EDGE_ATTRS: dict[str, ParamSpec] = {
    "stream": ParamSpec((bool,), False),
    "whole": ParamSpec((bool,), False),
    "chunk": ParamSpec((int, Auto, list)),
    "context": ParamSpec(_INT, 0),
    "credits": ParamSpec(_INT),
    "adapter": ParamSpec((Ref,)),
}
OUTPUT_ATTRS: dict[str, ParamSpec] = {
    "rate": ParamSpec(_INT),
    # A video output's frames per second (what its MP4 is written at, unless a request says).
    "fps": ParamSpec(_INT),
    "format": ParamSpec(_STR, choices=("wav", "pcm", "flac", "mp3", "png", "jpeg")),
}


def parse_port_list(text: str) -> dict[str, str]:
    """`"prompt:text, audio"` -> {"prompt": "text", "audio": "audio"} (a bare type names its port)."""
    ports = {}
    for item in (p.strip() for p in text.split(",")):
        if item:
            name, _, typ = item.partition(":")
            ports[name.strip()] = (typ or name).strip()
    return ports


def stage_ports(
    kind: str, params: dict[str, object]
) -> tuple[dict[str, tuple[str, ...]], dict[str, str]]:
    """Input ports (accepted types) and output ports (type) of a stage of `kind`."""
    spec = KINDS[kind]
    if kind != "python":
        return spec.inputs, spec.outputs
    ins = params.get("inputs", spec.params["inputs"].default)
    outs = params.get("outputs", spec.params["outputs"].default)
    if isinstance(ins, Param) or isinstance(outs, Param):
        raise TypeError("python stage ports cannot come from a parameter")
    return {k: (v,) for k, v in parse_port_list(ins).items()}, parse_port_list(outs)
