"""The talker's prompt, as `Qwen3TTSForConditionalGeneration.generate` builds it.

Every prompt row is a text-side row plus a codec-side row, both `[D]` (the talker's width):
text rows are token ids through the text embedding and the text projection, codec rows
talker ids through the codec embedding. With the assistant turn `<|im_start|>assistant\\n
{text}<|im_end|>\\n<|im_start|>assistant\\n` tokenized as `ids`:

1. the instruction, if any: `<|im_start|>user\\n{instructions}<|im_end|>\\n`, text rows alone
   (VoiceDesign's voice description; CustomVoice's optional style instruction);
2. the role, `ids[:3]`, text rows alone;
3. the codec tag and speaker: codec ids `[nothink, think_bos, think_eos]` (language Auto)
   or `[think, think_bos, LANG, think_eos]`, then the speaker row (a CustomVoice speaker's
   codec embedding, or a voice clone's x-vector; VoiceDesign has none), then `[pad, bos]`;
   every row but the last (bos) is summed with `tts_pad`, the last of them with `tts_bos`;
4. then, by mode:
   - non-streaming (the reference's default for CustomVoice and VoiceDesign): the whole
     text `ids[3:-5]` and `tts_eos`, each with codec `pad`, then `tts_pad + bos`; every
     decode step adds `tts_pad`;
   - streaming text (its default for voice clones): the first text token plus codec `bos`;
     decode step k adds text row k + 1, then `tts_eos`, then `tts_pad` for ever;
   - voice clone with reference codes (ICL): text rows of the reference transcript and
     the text, and `tts_eos`, beside the codec rows `bos` then one per reference frame
     (the sum of its 16 codebook embeddings); streamed, they are summed position by
     position and whichever is longer goes on (text rows as decode steps' rows, or
     codec rows summed with `tts_pad`); non-streaming, the text rows (with codec `pad`)
     come first, then the codec rows with `tts_pad`.

A CustomVoice speaker with a dialect (`spk_is_dialect`) speaks it when the language is
Chinese or Auto. Decode step k then feeds the talker the sum of the previous frame's 16
codebook embeddings plus that step's text-side row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniflow.families.qwen3_tts.config import (
    REF_TAIL_TOKENS,
    ROLE_TOKENS,
    TAIL_TOKENS,
    Qwen3TTSError,
    TalkerLayout,
)
from omniflow.runtime.readback import upload


@dataclass
class TTSRequest:
    """One request's task inputs, checked against the checkpoint (`check`)."""

    text: str
    task: str  # CustomVoice, VoiceDesign or Base
    language: str = "auto"
    speaker: str | None = None  # CustomVoice
    instructions: str = ""
    x_vector: torch.Tensor | None = None  # Base: the reference audio's speaker embedding
    ref_codes: torch.Tensor | None = None  # Base, ICL: `[frames, 16]`
    ref_text: str = ""
    non_streaming: bool | None = None  # None: the reference's default for the task

    @property
    def streaming_text(self) -> bool:
        if self.non_streaming is None:
            return self.task == "Base"
        return not self.non_streaming


def assistant_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def ref_turn(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n"


def instruct_text(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n"


def language_id(layout: TalkerLayout, language: str, speaker: str | None) -> int | None:
    """The codec id of the request's language (None for Auto), a dialect speaker's dialect
    in place of Chinese or Auto."""
    name = (language or "auto").lower()
    if name != "auto" and name not in layout.languages:
        raise Qwen3TTSError(
            f"unknown language {language!r}; this model speaks {', '.join(n.title() for n in layout.language_names())}"
        )
    chosen = None if name == "auto" else layout.languages[name]
    if speaker and name in ("chinese", "auto") and speaker.lower() in layout.dialects:
        chosen = layout.languages[layout.dialects[speaker.lower()]]
    return chosen


def tokenize(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text).input_ids)


@dataclass
class TalkerPrompt:
    embeds: torch.Tensor  # [L, D]: the prefill
    trailing: torch.Tensor  # [T, D]: decode step k's text-side row for k < T
    pad: torch.Tensor  # [D]: tts_pad, every later step's


@dataclass
class PromptIds:
    """One request's prompt as token and codec ids (`plan`: host work only)."""

    request: TTSRequest
    role: tuple[int, ...]  # the role's ids, `ids[:ROLE_TOKENS]`
    segments: list[list[int]]  # text ids: the instruction; the text, or its first id and the rest
    codec: list[int]  # the codec tag, the speaker, pad, bos, then the pads beside the text
    head: int  # of `codec`, the tag's and the speaker's ids
    speaker: bool
    split: bool  # streamed text: the first token goes with the prefill
    icl: bool


def plan(tokenizer, layout: TalkerLayout, request: TTSRequest) -> PromptIds:
    """A request's prompt ids (raises Qwen3TTSError where it has none: an empty text)."""
    ids = tokenize(tokenizer, assistant_text(request.text))
    if len(ids) <= ROLE_TOKENS + TAIL_TOKENS:
        raise Qwen3TTSError("the text to speak is empty")
    text_ids = ids[ROLE_TOKENS:-TAIL_TOKENS]
    icl = request.ref_codes is not None
    if icl:  # the reference's transcript, then the text
        ref = tokenize(tokenizer, ref_turn(request.ref_text))[ROLE_TOKENS:-REF_TAIL_TOKENS]
        text_ids = ref + text_ids
    instructions = request.instructions
    segments = [tokenize(tokenizer, instruct_text(instructions))] if instructions else []
    split = request.streaming_text and not icl
    segments += [text_ids[:1], text_ids[1:]] if split else [text_ids]
    lang = language_id(layout, request.language, request.speaker)
    tag = (
        [layout.nothink, layout.think_bos, layout.think_eos]
        if lang is None
        else [layout.think, layout.think_bos, lang, layout.think_eos]
    )
    speaker = layout.speakers[request.speaker.lower()] if request.speaker else []
    pads = 0 if request.streaming_text else len(text_ids) + 1  # beside the text and tts_eos
    codec = tag + speaker + [layout.codec_pad, layout.codec_bos] + [layout.codec_pad] * pads
    return PromptIds(
        request, tuple(ids[:ROLE_TOKENS]), segments, codec, len(tag) + len(speaker),
        bool(speaker), split, icl,
    )  # fmt: skip


def build(talker, tokenizer, layout: TalkerLayout, request: TTSRequest) -> TalkerPrompt:
    """The prefill rows and the decode steps' text-side rows of one request."""
    return embed(talker, layout, [plan(tokenizer, layout, request)])[0]


def embed(talker, layout: TalkerLayout, plans: list[PromptIds]) -> list[TalkerPrompt]:
    """The prompts of `plans`, built together: every request's token and codec ids go up
    to the device in one copy, and the text projection and the codec table each run once
    for all of them (a prompt built alone was ~15 launches, ~0.7 ms of a talker step's host
    time on an H100, paid by each request of a burst before any was prefilled); the special
    tokens' and the role's rows, the same in every prompt, are the talker's `fixed_text`."""
    if not plans:
        return []
    text = [i for p in plans for segment in p.segments for i in segment]
    flat = upload(text + [i for p in plans for i in p.codec], talker.codec_head.weight.device)
    text_rows, codec_rows = talker.text(flat[: len(text)]), talker.codec(flat[len(text) :])
    built, at, codec_at = [], 0, 0
    for p in plans:
        texts = []
        for segment in p.segments:
            texts.append(text_rows[at : at + len(segment)])
            at += len(segment)
        built.append(
            _assemble(talker, layout, p, texts, codec_rows[codec_at : codec_at + len(p.codec)])
        )
        codec_at += len(p.codec)
    return built


def _assemble(talker, layout: TalkerLayout, p: PromptIds, texts: list, codec_rows) -> TalkerPrompt:
    """One request's rows from its projected text segments and codec rows (see the module
    docstring for the layout)."""
    request = p.request
    tts_bos, tts_eos, tts_pad = talker.fixed_text((layout.tts_bos, layout.tts_eos, layout.tts_pad))
    rows = texts[:1] if request.instructions else []
    rows.append(talker.fixed_text(p.role))
    # The codec tag, the speaker (a CustomVoice speaker's row or a clone's x-vector), then
    # pad and bos: every row but bos beside tts_pad, the last of them beside tts_bos.
    head = p.head
    codec = [codec_rows[:head]]
    if not p.speaker and request.x_vector is not None:
        codec.append(request.x_vector.to(tts_pad.dtype).reshape(1, -1))
    codec = torch.cat([*codec, codec_rows[head : head + 1]])
    bos = codec_rows[head + 1]
    side = torch.cat([tts_pad.expand(len(codec) - 1, -1), tts_bos[None]])
    rows.append(side + codec)
    pad_rows = codec_rows[head + 2 :]

    if p.split:
        rows.append(texts[-2] + bos)
        trailing = torch.cat([texts[-1], tts_eos[None]])
        return TalkerPrompt(torch.cat(rows), trailing, tts_pad)
    text = torch.cat([texts[-1], tts_eos[None]])
    if not p.icl:
        rows += [text + pad_rows, (tts_pad + bos)[None]]
        return TalkerPrompt(torch.cat(rows), tts_pad[None], tts_pad)
    frames = torch.cat([bos[None], talker.frame_embeds(upload(request.ref_codes, bos.device))])
    trailing = tts_pad[None]
    if not request.streaming_text:
        rows += [text + pad_rows, frames + tts_pad]
    elif len(text) > len(frames):
        rows.append(text[: len(frames)] + frames)
        trailing = text[len(frames) :]
    else:
        padded = torch.cat([text, tts_pad.expand(len(frames) - len(text), -1)])
        rows.append(padded + frames)
    return TalkerPrompt(torch.cat(rows), trailing, tts_pad)
