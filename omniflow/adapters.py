"""Named adapters: model-specific transition functions that an edge applies on the way.

The compiler checks an edge's `adapter=` against this table (types in and out); the
runtime imports the implementation by its dotted path when it links the plan. A dotted
name outside the namespaces listed here is taken as a user function, resolved at link time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdapterSpec:
    in_type: str
    out_type: str
    impl: str  # "module:function" — a factory called with the source StagePlan
    doc: str
    # What the adapter needs its source `hidden` port to send per step: this many rows of
    # the hidden size, and (if `with_prompt`) a step for every prompt position too.
    source_rows: int = 1
    with_prompt: bool = False


ADAPTERS: dict[str, AdapterSpec] = {
    "qwen_omni.thinker_to_talker": AdapterSpec(
        "hidden",
        "hidden",
        "omniflow.backends.models.qwen_omni:thinker_to_talker",
        "thinker hidden states and token embeddings -> talker input embeddings",
        # Per position: hidden state, input embedding and a prompt/reply role row.
        source_rows=3,
        with_prompt=True,
    ),
    "qwen_omni.talker_to_code2wav": AdapterSpec(
        "codes",
        "codes",
        "omniflow.backends.models.qwen_omni:talker_to_code2wav",
        "talker codec tokens -> token2wav codes (drops control tokens)",
    ),
    "qwen3_omni.thinker_to_talker": AdapterSpec(
        "hidden",
        "hidden",
        "omniflow.families.qwen3_omni.thinker_talker:thinker_to_talker",
        "thinker accept-layer hidden states and token embeddings -> the talker's conditioning",
        # Per position: accept-layer hidden state, input embedding and a prompt/reply role row.
        source_rows=3,
        with_prompt=True,
    ),
    "qwen3_omni.talker_to_code2wav": AdapterSpec(
        "codes",
        "codes",
        "omniflow.families.qwen3_omni.thinker_talker:talker_to_code2wav",
        "talker frames (16 codebooks) -> code2wav codes (drops any outside the codebook)",
    ),
}

NAMESPACES = frozenset(name.split(".")[0] for name in ADAPTERS)
