"""Prompt lengths, checked at admission: an `ar` stage whose prompt is a pipeline input takes
prompts of at most the `max_len` tokens it was compiled for (its KV cache and buffers were
sized for that), counted with the stage's own tokenizer the way its generic path tokenizes
them (a chat through the chat template, a text as it tokenizes, token ids as given).

The frontend loads each such stage's tokenizer from the checkpoint on this machine (a tiny
one, a local folder, the Hugging Face cache); a stage whose checkpoint is not here, whose
tokenizer does not load, or whose prompt carries media parts (the stage counts those when
it expands them) is left to count its own prompt. The count a reply's `usage` reports is
the stage's own (`Ending`), never this one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from omniflow.catalog.components import cached_snapshot
from omniflow.catalog.resolve import TINY_SCHEME, model_path
from omniflow.hf_logging import quiet
from omniflow.plan import Plan
from omniflow.runtime.requests import Admitted, RequestError

PROMPT_TYPES = ("chat", "text", "tokens")


@dataclass(frozen=True)
class PromptLimit:
    """Stage `stage` takes input `input` (of `port_type`) as its prompt, of at most
    `max_len` tokens by `tokenizer`."""

    stage: str
    input: str
    port_type: str
    max_len: int
    tokenizer: object

    def count(self, value) -> int | None:
        """The prompt's tokens, or None where the stage must count them itself."""
        if self.port_type == "tokens":
            return int(value.numel()) if hasattr(value, "numel") else len(value)
        if self.port_type == "text":
            return len(self.tokenizer(value).input_ids)
        if any(isinstance(m.get("content"), list) for m in value):  # media parts
            return None
        text = self.tokenizer.apply_chat_template(value, add_generation_prompt=True, tokenize=False)
        return len(self.tokenizer(text).input_ids)

    def check(self, request: Admitted) -> None:
        tokens = self.count(request.inputs[self.input])
        if tokens is not None and tokens > self.max_len:
            raise RequestError(
                f"input '{self.input}' is a prompt of {tokens} tokens; stage '{self.stage}' "
                f"was compiled for prompts of at most {self.max_len} tokens (max_len)",
                self.input,
            )


def prompt_limits(plan: Plan) -> tuple[PromptLimit, ...]:
    """A `PromptLimit` for every `ar` stage fed a prompt by a pipeline input, whose
    tokenizer loads from this machine."""
    inputs = {i.name for i in plan.inputs}
    limits = []
    for channel in plan.channels:
        stage = next((s for s in plan.stages if s.name == channel.dst), None)
        if (
            stage is None
            or stage.kind != "ar"
            or channel.dst_port != "prompt"
            or channel.src not in inputs
            or channel.type not in PROMPT_TYPES
        ):
            continue
        tokenizer = _local_tokenizer(stage.model)
        if tokenizer is not None:
            limits.append(
                PromptLimit(
                    stage.name, channel.src, channel.type, stage.settings["max_len"], tokenizer
                )
            )
    return tuple(limits)


# transformers resolves its lazy attributes without a lock: engines that start in threads
# of one process (`omniflow run` with several pipelines) would race on the first import.
_IMPORTING = threading.Lock()


def _local_tokenizer(model: str | None):
    """The tokenizer of `model`'s checkpoint if it is on this machine, else None."""
    with _IMPORTING:
        from transformers import AutoTokenizer

    if model is None:
        return None
    if model.startswith(TINY_SCHEME) or Path(model).expanduser().is_dir():
        path = model_path(model)
    elif (snapshot := cached_snapshot(model)) is not None:
        path = str(snapshot[1])
    else:
        return None
    try:
        with quiet():
            return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError):
        return None
