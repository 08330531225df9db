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
tokenizer whose normalizer dropped text wholesale would be refused too early.)

Media count too, where the family of the encoder stage that takes them says how many
embeddings an item gives from its size alone (`Family.media_tokens`: an image's width and
height, a clip's samples, a video's frames as its header declares them; nothing is decoded
again): against that stage's `max_len` (`MediaLimit`: its packed embeddings and a header row
an item) and, beside the chat's text, against the `max_len` of the `ar` stage whose prompt
holds their embeddings (a chat with media parts counts its text's tokens without the
template's: the prompt has at least that many). Without either, a video too long for the
plan failed in its stage as a server error.

The frontend loads each such stage's tokenizer from the checkpoint on this machine (a tiny
one, a local folder, the Hugging Face cache); a stage whose checkpoint is not here, or whose
tokenizer does not load, is left to count its own prompt. The count a reply's `usage`
reports is the stage's own (`Ending`), never this one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from omniflow.hf_logging import quiet
from omniflow.plan import Plan, StagePlan
from omniflow.runtime.port_values import MEDIA_TYPES
from omniflow.runtime.preflight import local_checkpoint
from omniflow.runtime.python_backend import import_function
from omniflow.runtime.requests import Admitted, RequestError

PROMPT_TYPES = ("chat", "text", "tokens")
# A family's count of one media item's embeddings: (kind, the item) -> tokens.
MediaCounter = Callable[[str, object], int]


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
    then the others its family puts there, then the media whose embeddings it holds) into
    its prompt, of at most `max_len` tokens by `tokenizer`, none of whose tokens stands for
    more than `token_bytes` bytes; `media` counts a media input's items (input -> the
    count of the encoder stage that takes it)."""

    stage: str
    inputs: tuple[tuple[str, str], ...]
    max_len: int
    tokenizer: object
    token_bytes: int
    media: Mapping[str, MediaCounter] = field(default_factory=dict)

    def count(self, port_type: str, value, name: str = "") -> Count:
        """One input's tokens: at least its bytes over `token_bytes` where that is already
        past the limit (then it is not tokenized), else as the stage tokenizes it; a media
        input's, as `media` counts them."""
        if port_type in MEDIA_TYPES:
            return Count(sum(self.media[name](port_type, item) for item in _items(value)))
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
            counts[name] = self.count(port_type, request.inputs[name], name)
            total += counts[name].tokens
            if total > self.max_len:
                break  # the rest need no counting
        if total > self.max_len:
            raise _too_long(
                counts,
                "tokens",
                "a prompt",
                f"stage '{self.stage}' was compiled for prompts of at most {self.max_len} "
                "tokens (max_len)",
            )


@dataclass(frozen=True)
class MediaLimit:
    """Encoder stage `stage` takes the media of the pipeline inputs `inputs` ((name, port
    type)) and packs each item's embeddings (as `count` counts them) after a header row of
    its own into at most `rows` rows (`omniflow.backends.vision.pack_media`)."""

    stage: str
    inputs: tuple[tuple[str, str], ...]
    rows: int
    count: MediaCounter

    def check(self, request: Admitted) -> None:
        counts = {
            name: Count(sum(1 + self.count(kind, item) for item in _items(request.inputs[name])))
            for name, kind in self.inputs
            if request.inputs.get(name) is not None
        }
        if sum(c.tokens for c in counts.values()) > self.rows:
            raise _too_long(
                counts,
                "embedding rows",
                "media",
                f"stage '{self.stage}' was compiled for at most {self.rows} (max_len "
                f"{self.rows - 1}: an item's embeddings and a header row each)",
            )


def _too_long(counts: dict[str, Count], unit: str, whole: str, limit: str) -> PromptTooLong:
    """The refusal of inputs whose `counts` together are past `limit`, naming the input that
    brings the most."""
    total = sum(c.tokens for c in counts.values())
    field_ = max(counts, key=lambda name: counts[name].tokens)
    least = "" if all(c.exact for c in counts.values()) else "at least "
    most = counts[field_]
    others = [f"'{n}' {c.tokens}" for n, c in counts.items() if n != field_ and c.tokens]
    if others:
        brings = f"{'' if most.exact else 'at least '}{most.tokens} {unit}"
        what = f"brings {brings} to {whole} of {least}{total} {unit} (with {', '.join(others)})"
    else:
        what = f"is {whole} of {least}{total} {unit}"
    return PromptTooLong(f"input '{field_}' {what}; {limit}", field_)


def _items(value) -> list:
    """A media input's items: a list of several, or one."""
    return value if isinstance(value, list) else [value]


def _text_of(content) -> str:
    """A chat message's text: its content, or its text parts'."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and _is_text(p))
    return ""


def _is_text(part: dict) -> bool:
    return part.get("type") == "text" and isinstance(part.get("text"), str)


def prompt_limits(plan: Plan) -> tuple[PromptLimit | MediaLimit, ...]:
    """A `MediaLimit` for every encoder stage fed media by pipeline inputs whose family
    counts them from this machine's checkpoint; a `PromptLimit` for every `ar` stage fed a
    prompt by a pipeline input, whose tokenizer loads from this machine (with the media of
    the counted encoder stages that feed it)."""
    inputs = {i.name for i in plan.inputs}
    counted: dict[str, tuple[MediaCounter, tuple[tuple[str, str], ...]]] = {}
    limits: list[PromptLimit | MediaLimit] = []
    for stage in plan.stages:
        media = tuple(
            (c.src, c.type)
            for c in plan.channels
            if c.dst == stage.name and c.src in inputs and c.type in MEDIA_TYPES
        )
        count = _media_counter(stage) if stage.kind == "encoder" and media else None
        if count is not None:
            counted[stage.name] = (count, media)
            limits.append(MediaLimit(stage.name, media, stage.settings["max_len"] + 1, count))
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
        tokenizer = _local_tokenizer(stage.model, stage.component)
        if tokenizer is None:
            continue
        # Counting a prompt past the checkpoint's own context is this check's job: no
        # warning that it would not fit the model (transformers logs one per tokenizer).
        tokenizer.model_max_length = 1 << 62
        encoders = {c.src for c in plan.channels if c.dst == stage.name and c.src in counted}
        media = {name: counted[e][0] for e in sorted(encoders) for name, _ in counted[e][1]}
        limits.append(
            PromptLimit(
                stage.name,
                tuple(fed[port] for port in ports if port in fed)
                + tuple(m for e in sorted(encoders) for m in counted[e][1]),
                stage.settings["max_len"],
                tokenizer,
                max(len(token.encode()) for token in tokenizer.get_vocab()),
                media,
            )
        )
    return tuple(limits)


def _media_counter(stage: StagePlan) -> MediaCounter | None:
    """The stage's family's count of its media (`Family.media_tokens`), where it has one and
    the checkpoint is on this machine."""
    hook = stage.family.media_tokens if stage.family is not None else None
    path = local_checkpoint(stage.model)
    if not hook or path is None:
        return None
    with _IMPORTING:  # (it loads processors' settings: transformers' lazy imports)
        return import_function(hook)(stage, path)


# transformers resolves its lazy attributes without a lock: engines that start in threads
# of one process (`omniflow run` with several pipelines) would race on the first import.
_IMPORTING = threading.Lock()


def _local_tokenizer(model: str | None, component: str | None = None):
    """The tokenizer of `model`'s checkpoint if it is on this machine, else None: at its
    root, else in the folder of the stage's `component` (a multi-part checkpoint whose
    language model keeps its tokenizer beside it: without it such a stage went uncounted,
    and a megabyte of text held its executor for minutes)."""
    with _IMPORTING:
        from transformers import AutoTokenizer

    path = local_checkpoint(model)
    if path is None:
        return None
    folders = [Path(path)]
    if component and (Path(path) / component).is_dir():
        folders.append(Path(path) / component)
    for folder in folders:
        try:
            with quiet():
                return AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError, KeyError):
            continue
    return None
