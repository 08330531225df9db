"""The code2wav stage: the 12 Hz speech tokenizer's decoder as a `Decoder` of the vocoder
backend (`omniflow.backends.vocoders`).

Frames arrive as int64 `[n, 16]` rows (codebook 0 first) and decode to 1920 samples each.
The decoder is causal, so it needs no lookahead and its reach behind is what its layers
walk to (`speech_tokenizer.SpeechDecoder.field`); an edge whose left context covers it
streams exactly the whole-utterance decode (up to float rounding), and a shorter one
(Qwen's own streaming decode keeps 25 frames) approximates it. Windows of several
requests are padded on the right (causal: padding after a window reaches none of its
samples) and decoded in one forward.

A voice clone with reference codes (ICL) starts with the reference's frames, every code
offset by the codebook size (2048): they are decoded as the first frames' context and
emit no audio, as Qwen's `generate_voice_clone` decodes reference and new codes together
and cuts the reference's share.
"""

from __future__ import annotations

import torch

from omniflow.backends.vocoders import (
    Decoder,
    Window,
    checked_samples_per_frame,
    field_reach,
    padded,
)
from omniflow.families.qwen3_tts.speech_tokenizer import SpeechDecoder, load_decoder


def load(root: str, component: str | None, device: str) -> Code2Wav:
    """The code2wav decoder of the Qwen3-TTS checkpoint at `root` (component `code2wav`)."""
    from omniflow.backends.vocoders import VocoderError

    if component not in (None, "code2wav"):
        raise VocoderError(
            f"Qwen3-TTS has no '{component}' decoder; use component=\"code2wav\" "
            "(the talker runs on an ar stage)"
        )
    return Code2Wav(load_decoder(root, device), device)


class Code2Wav(Decoder):
    def __init__(self, model: SpeechDecoder, device: str):
        self.model = model
        self.device = device
        field = model.field()

        def decode(frames: int) -> torch.Tensor:
            codes = torch.zeros(1, model.num_quantizers, frames, dtype=torch.int64, device=device)
            return model(codes)

        with torch.inference_mode():
            per_frame = checked_samples_per_frame(field, decode)
        reach = field_reach(field)
        super().__init__(
            per_frame, model.num_quantizers, model.codebook_size, reach, reach.lookahead
        )

    def context_frames(self, state: dict, chunk: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A voice clone's reference frames, which the talker sends first with every code
        offset by the codebook size: decoded as context (Qwen's `generate_voice_clone`
        decodes them before the new frames and cuts their audio), not emitted."""
        if state.get("generated") or not len(chunk):
            return chunk, 0
        marked = (chunk >= self.codebook_size).all(dim=1)
        count = int(marked.long().cumprod(0).sum())
        if count == len(chunk):
            return chunk - self.codebook_size, count
        state["generated"] = True
        codes = chunk.clone()
        codes[:count] -= self.codebook_size
        return codes, count

    def decode(self, windows: list[Window], frames: int) -> torch.Tensor:
        codes = padded(windows, frames, Window.codes, self.device).transpose(1, 2)
        return self.model(codes).reshape(len(windows), -1)
