"""Prompt lengths, checked at admission: an `ar` stage whose prompt is a pipeline input takes
prompts of at most the `max_len` tokens it was compiled for (its KV cache and buffers were
sized for that), counted with the stage's own tokenizer the way its generic path tokenizes
them (a chat through the chat template, a text as it tokenizes, token ids as given). The
other text inputs its model family puts into the prompt (`FamilyCode.prompt_inputs`: a TTS
talker's instruction and reference transcript) count with it; a refusal names the input
that brings the most.

Counting never costs more than the limit is worth: a text of more bytes than `max_len`
tokens can stand for (the vocabulary's longest token, in bytes, times `max_len`) is refused
untokenized, so a megabyte of text is refused in microseconds. (A token stands for at most
its own spelling's bytes of the text in byte-level BPE and SentencePiece vocabularies; a
tokenizer whose normalizer dropped text wholesale would be refused too early.) A chat with media parts
counts its text alone (the stage adds the media's tokens when it expands them: at least
that many).

The frontend loads each such stage's tokenizer from the checkpoint on this machine (a tiny
one, a local folder, the Hugging Face cache); a stage whose checkpoint is not here, or whose
tokenizer does not load, is left to count its own prompt. The count a reply's `usage`
reports is the stage's own (`Ending`), never this one.
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


class PromptTooLong(RequestError):
    """A request's prompt is longer than a stage was compiled for; `field` names the input
    that brings the most of it."""


@dataclass(frozen=True)
class Count:
    """An input's tokens in a prompt: `tokens`, exactly, or at least that many (`exact`)."""

    tokens: int
    exact: bool = True


@dataclass(frozen=True)
class PromptLimit:
    """Stage `stage` puts the pipeline inputs `inputs` ((name, port type): its prompt's,
    then the others its family puts there) into its prompt, of at most `max_len` tokens by
    `tokenizer`, none of whose tokens stands for more than `token_bytes` bytes."""

    stage: str
    inputs: tuple[tuple[str, str], ...]
    max_len: int
    tokenizer: object
    token_bytes: int

    def count(self, port_type: str, value) -> Count:
        """One input's tokens: at least its bytes over `token_bytes` where that is already
        past the limit (then it is not tokenized), else as the stage tokenizes it."""
        if port_type == "tokens":
            return Count(int(value.numel()) if hasattr(value, "numel") else len(value))
        if port_type == "text":
            return self._text(value)
        texts = [_text_of(m.get("content")) for m in value]
        floor = self._floor(texts)
        if floor is not None:
            return floor
        if any(isinstance(m.get("content"), list) for m in value):  # parts: media, maybe
            return Count(self._text("\n".join(texts)).tokens, exact=False)
        text = self.tokenizer.apply_chat_template(value, add_generation_prompt=True, tokenize=False)
        return self._text(text)

    def _text(self, text: str) -> Count:
        return self._floor([text]) or Count(len(self.tokenizer(text).input_ids) if text else 0)

    def _floor(self, texts: list[str]) -> Count | None:
        """At least this many tokens, where that is past the limit already."""
        floor = -(-sum(len(t.encode()) for t in texts) // self.token_bytes)
        return Count(floor, exact=False) if floor > self.max_len else None

    def check(self, request: Admitted) -> None:
        counts, total = {}, 0
        for name, port_type in self.inputs:
            if request.inputs.get(name) is None:
                continue  # an optional input left out
            counts[name] = self.count(port_type, request.inputs[name])
            total += counts[name].tokens
            if total > self.max_len:
                break  # the rest need no counting
        if total <= self.max_len:
            return
        field = max(counts, key=lambda name: counts[name].tokens)
        least = "" if all(c.exact for c in counts.values()) else "at least "
        others = [f"'{n}' {c.tokens}" for n, c in counts.items() if n != field and c.tokens]
        if others:
            most = counts[field]
            what = (
                f"input '{field}' brings {'' if most.exact else 'at least '}{most.tokens} "
                f"tokens to a prompt of {least}{total} tokens (with {', '.join(others)})"
            )
        else:
            what = f"input '{field}' is a prompt of {least}{total} tokens"
        raise PromptTooLong(
            f"{what}; stage '{self.stage}' was compiled for prompts of at most "
            f"{self.max_len} tokens (max_len)",
            field,
        )


def _text_of(content) -> str:
    """A chat message's text: its content, or its text parts'."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and _is_text(p))
    return ""


def _is_text(part: dict) -> bool:
    return part.get("type") == "text" and isinstance(part.get("text"), str)


def prompt_limits(plan: Plan) -> tuple[PromptLimit, ...]:
    """A `PromptLimit` for every `ar` stage fed a prompt by a pipeline input, whose
    tokenizer loads from this machine."""
    inputs = {i.name for i in plan.inputs}
    limits = []
    for stage in plan.stages:
        if stage.kind != "ar":
            continue
        ports = ["prompt", *(stage.family.prompt_inputs if stage.family is not None else ())]
        fed = {
            c.dst_port: (c.src, c.type)
            for c in plan.channels
            if c.dst == stage.name and c.src in inputs and c.type in PROMPT_TYPES
        }
        if "prompt" not in fed:
            continue
        tokenizer = _local_tokenizer(stage.model)
        if tokenizer is not None:
            # Counting a prompt past the checkpoint's own context is this check's job: no
            # warning that it would not fit the model (transformers logs one per tokenizer).
            tokenizer.model_max_length = 1 << 62
            limits.append(
                PromptLimit(
                    stage.name,
                    tuple(fed[port] for port in ports if port in fed),
                    stage.settings["max_len"],
                    tokenizer,
                    max(len(token.encode()) for token in tokenizer.get_vocab()),
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
