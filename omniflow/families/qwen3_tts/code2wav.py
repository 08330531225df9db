"""The code2wav stage: the 12 Hz speech tokenizer's decoder as a `Decoder` of the vocoder
backend (`omniflow.backends.vocoders`).

Frames arrive as int64 `[n, 16]` rows (codebook 0 first) and decode to 1920 samples each.
The decoder is causal and carries each stream's state from one window to the next
(`stateful`: its convolutions' last inputs, its attention layers' keys and values), so a
window decodes only its new frames and a stream's audio is its whole-utterance decode, up
to float rounding, in windows of any size, one frame included. Its reach behind (what its
layers walk to, `speech_tokenizer.SpeechDecoder.field`) is what a decode without carried
state would need as left context; Qwen's own streaming decode keeps 25 frames and
approximates it.

State slots and static windows (`omniflow.backends.carried_state.StatefulDecoder`, which
this decoder is: `carried_forward` is `SpeechDecoder.forward` with its carried state). Every
stream's state lives in a slot allocated when the stage loads (`init_states`, slots = the
stage's max_batch); a step's inputs are the padded codes `[B, 16, T]` and each row's slot,
position and length, so it is captured as a CUDA graph per (batch bucket, window length)
(`prepare`, the stage's decode "graphs", the default on CUDA; "static" runs the same
buffers eagerly on the CPU).

A voice clone with reference codes (ICL) starts with the reference's frames, every code
offset by the codebook size (2048), the last frame's by twice that (so that this stage
knows when it has them all): they are decoded as the first frames' context, in a window of
their own (a static one where they fit the longest, else eagerly), and emit no audio, as
Qwen's `generate_voice_clone` decodes reference and new codes together and cuts the
reference's share.
"""

from __future__ import annotations

import torch

from omniflow.backends.carried_state import Carried, StatefulDecoder
from omniflow.backends.vocoders import checked_samples_per_frame, field_reach
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


class Code2Wav(StatefulDecoder):
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

    def context_frames(self, state: dict, chunk: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
        """A voice clone's reference frames, which the talker sends first with every code
        offset by the codebook size, the last one's by twice that (the talker's `prompt`):
        decoded as context (Qwen's `generate_voice_clone` decodes them before the new frames
        and cuts their audio), not emitted."""
        if state.get("generated") or not len(chunk):
            return chunk, 0, False
        size = self.codebook_size
        marked = (chunk >= size).all(dim=1)
        count = int(marked.long().cumprod(0).sum())
        codes = chunk.clone()
        codes[:count] %= size
        last = count > 0 and bool((chunk[count - 1] >= 2 * size).all())
        if count < len(chunk):
            state["generated"] = True
        return codes, count, last or count < len(chunk)

    def carried_forward(self, codes: torch.Tensor, carried: Carried) -> torch.Tensor:
        return self.model(codes, carried)
