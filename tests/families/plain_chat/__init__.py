"""A model family registered from outside omniflow, for tests/families/test_new_family.py:
a plain causal chat LM (`model_type` qwen3) whose prompt is a transcript ("User: ...",
"Assistant:") rather than its tokenizer's chat template.

What a family folder holds, in small: this descriptor (torch-free: the architecture it
serves, its run-time code by dotted path, its tiny checkpoint and the hub id it stands in
for, its published config under configs/), and its run-time half (`runtime.py`).
"""

from pathlib import Path

from omniflow.families import Family, TinyModel

REAL_ID = "example/plain-chat-lm"

FAMILY = Family(
    name="plain_chat",
    doc=__doc__,
    architectures=("qwen3",),
    runtime={("ar", "transformers"): f"{__name__}.runtime:load"},
    tiny=(
        TinyModel(
            "plain-chat",
            "Qwen3ForCausalLM: 2-layer, 64-wide chat LM prompted with a transcript",
            ("tokenizer", "model", "save"),
            f"{__name__}.runtime:build_tiny",
            counterparts=(REAL_ID,),
        ),
    ),
    configs=str(Path(__file__).parent / "configs"),
)
