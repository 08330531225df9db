"""A text-to-speech codec language model as a component of the transformers `ar` backend.

The checkpoint (Qwen3-TTS's layout, as `tiny:tts` mirrors it) is a directory of parts
named by `model_index.json`: the codec LM (`talker/`, a causal LM with its tokenizer) and
the codec decoder (`code2wav/`, run by a vocoder stage). The index also gives the codec-token
layout and the speakers. This reproduces the unsplit pipeline
(`omniflow.families.codec_tts.checkpoints.reference_tts`):

- the prompt is `text_template.format(text=...)` tokenized, then the voice's speaker
  token, then codec bos;
- sampling is the talker's `generate()`: its generation config (greedy when `do_sample`
  is false) and its `suppress_tokens`, which leave only codec tokens and end-of-speech;
- the stage emits each sampled codec token on `codes` as a DAC code (`codec_token_offset`
  subtracted), int64 `[1, 1]`, and stops at end-of-speech, which it does not emit.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omniflow.backends.checkpoint_files import INDEX, read_json
from omniflow.backends.transformers_ar import ARBackendError, CausalLM, Prompt
from omniflow.runtime.stage import Call

_LAYOUT = ("codec_token_offset", "codebook_size", "codec_bos_token_id", "speakers")


def speakers(path: str) -> tuple[str, ...] | None:
    """The speakers the local checkpoint's index lists (each a codec token)."""
    index = Path(path) / INDEX
    if not index.is_file():
        return None
    listed = json.loads(index.read_text(encoding="utf-8")).get("speakers")
    return tuple(listed) if listed else None


def load(path: str, component: str | None, device: str, dtype) -> CausalLM:
    """The codec LM part `component` of the checkpoint of parts at `path`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    index = read_json(path, INDEX) or {}
    lms = [
        name
        for name, part in index.items()
        if isinstance(part, list) and len(part) == 2 and str(part[1]).endswith("ForCausalLM")
    ]
    missing = [key for key in _LAYOUT if key not in index]
    if missing:
        raise ARBackendError(f"{path}: {INDEX} lacks the codec-token layout ({', '.join(missing)})")
    if component not in lms:
        raise ARBackendError(
            f"{path} has no codec language model '{component}'; "
            f"use component={' or '.join(repr(n) for n in lms) or '(none)'}"
        )
    model = AutoModelForCausalLM.from_pretrained(path, subfolder=component, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(
        path, subfolder=index.get("tokenizer_subfolder", component)
    )
    return CodecLM(model.to(device).eval(), tokenizer, index)


class CodecLM(CausalLM):
    """A codec LM prompted with a text and a voice (both text inputs)."""

    inputs = {"prompt": ("text",), "voice": ("text",)}
    required = frozenset({"prompt", "voice"})
    outputs = frozenset({"codes", "tokens", "hidden"})

    def __init__(self, model, tokenizer, index: dict):
        super().__init__(model, tokenizer)
        self.template = index.get("text_template", "{text}")
        self.speakers = {str(k): int(v) for k, v in index["speakers"].items()}
        self.bos = int(index["codec_bos_token_id"])
        self.offset = int(index["codec_token_offset"])
        self.codebook = int(index["codebook_size"])

    def can_start(self, call: Call) -> bool:
        return call.inputs["prompt"].ended and call.inputs["voice"].ended

    def prompt(self, call: Call) -> Prompt:
        text, voice = call.inputs["prompt"].take(), call.inputs["voice"].take()
        if not isinstance(text, str) or not text:
            raise ARBackendError("the text to speak is empty")
        if voice not in self.speakers:
            raise ARBackendError(
                f"unknown voice {voice!r}; this model has {', '.join(self.speakers)}"
            )
        ids = [
            *self.tokenizer(self.template.format(text=text)).input_ids,
            self.speakers[voice],
            self.bos,
        ]
        tensor = torch.tensor(ids, device=self.embed.weight.device)
        return Prompt(self.embed(tensor), ids)

    def code(self, token: int) -> torch.Tensor | None:
        """A sampled codec token as a DAC code `[1, 1]`; None for end-of-speech (and any
        other id outside the codebook, which the suppress mask keeps from being sampled)."""
        code = token - self.offset
        if token in self.eos_ids or not 0 <= code < self.codebook:
            return None
        return torch.tensor([[code]])
