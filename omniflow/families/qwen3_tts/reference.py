"""The unsplit Qwen3-TTS run the staged pipeline is compared against: one request, the
talker's prefill then its decode loop with the code predictor inside, as
`Qwen3TTSForConditionalGeneration.generate` runs it (codebook 0 greedy or sampled after the
repetition penalty, the special-id suppression and the two-step end-of-speech mask), then
the whole utterance through the speech tokenizer's decoder at once.

It shares the modules and the prompt builder with the stages, not their scheduling: no
batching, no streaming, no backend. Where the `qwen_tts` reference package can be imported,
tests/families/test_qwen3_tts.py checks that this run gives the reference's codes.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from omniflow.backends.transformers_ar import complete_frames
from omniflow.families.qwen3_tts import prompt as prompts
from omniflow.families.qwen3_tts.talker import MIN_NEW_TOKENS, load


class Reference(NamedTuple):
    """codes: `[frames, 16]` int64 (end-of-speech excluded); waveform: `[frames * 1920]`."""

    codes: torch.Tensor
    waveform: torch.Tensor


@torch.inference_mode()
def reference_generate(
    model_dir: str | Path,
    request: prompts.TTSRequest,
    max_new_tokens: int = 16,
    repetition_penalty: float | None = None,
) -> Reference:
    """Greedy generation of `request` on the checkpoint, and its whole decode. With the
    reference's `max_new_tokens` N, `generate` returns the frames of its first N - 1 codes
    (the last code's frame is never predicted); this returns `max_new_tokens` frames."""
    from transformers import DynamicCache

    from omniflow.families.qwen3_tts.speech_tokenizer import load_decoder

    component = load(str(model_dir), "talker", "cpu", "auto")
    talker, layout = component.model, component.layout
    penalty = (
        component.defaults["repetition_penalty"]
        if repetition_penalty is None
        else repetition_penalty
    )
    built = prompts.build(talker, component.tokenizer, layout, request)
    cache = DynamicCache(config=talker.config)
    embeds, position, frames, seen = built.embeds[None], 0, [], []
    for step in range(max_new_tokens):
        length = embeds.shape[1]
        positions = torch.arange(position, position + length)[None]
        hidden = talker.model(
            inputs_embeds=embeds, position_ids=positions, cache=cache, use_cache=True
        )
        position += length
        last = hidden.last_hidden_state[0, -1]
        logits = talker.codec_head(last).float()
        if seen:  # transformers' repetition penalty over the generated codes
            ids = torch.tensor(sorted(set(seen)))
            picked = logits[ids]
            logits[ids] = torch.where(picked < 0, picked * penalty, picked / penalty)
        logits[list(layout.suppressed)] = -float("inf")
        if step < MIN_NEW_TOKENS:
            logits[layout.codec_eos] = -float("inf")
        token = int(logits.argmax())
        if token == layout.codec_eos:
            break
        seen.append(token)
        frame = complete_frames(
            component.frame_spec, talker.codec_embedding, last[None], torch.tensor([token])
        )
        frames.append(frame[0])
        side = built.trailing[step] if step < len(built.trailing) else built.pad
        embeds = (talker.frame_embeds(frame) + side)[None]
    codes = (
        torch.stack(frames) if frames else torch.zeros(0, layout.num_code_groups, dtype=torch.long)
    )
    decoder = load_decoder(str(model_dir), "cpu")
    waveform = decoder(codes.T[None]).reshape(-1) if len(codes) else torch.zeros(0)
    return Reference(codes, waveform)
