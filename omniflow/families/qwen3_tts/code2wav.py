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

State slots. Every stream's state lives in `speech_tokenizer.StateSlots`, device buffers
of `[slots + 1, ...]` allocated when the stage loads (`init_states`, slots = the stage's
max_batch); the backend gives each stream a slot for its life. A step's inputs are the
padded codes `[B, 16, T]` and three index tensors `[B]`: each row's slot, position (frames
decoded before; 0 reads zeros whatever the slot held) and length (its real frames: the
state it keeps is taken at its own last frame, so the right padding never reaches it).

Graphs (`prepare`, the stage's decode "graphs", the default on CUDA). A step's every
kernel, from the codebook lookups to the last conv, is one forward of fixed shapes over
those inputs and the slot buffers, so it is captured as a CUDA graph per (batch bucket,
window length): batch buckets 1, 2, 4, then multiples of 8 up to max_batch
(`static_decode.batch_buckets`), window lengths powers of two up to the edge's longest
chunk (`Vocoder.grid_lengths`), while batch x length is at most GRAPH_FRAMES. A step pads its rows up to its batch bucket with rows of
length 0 in the scratch slot, and its windows on the right up to the window length, and
replays; captured at load, largest first, in one pool, none after. A forward without a
graph (longer than every length, as a voice clone's first window with its reference
frames, or more frames than GRAPH_FRAMES) runs the same forward eagerly at its own shape; "static" (CPU) runs the same buffers eagerly, so the CPU
tests exercise the replayed path's bookkeeping.

A voice clone with reference codes (ICL) starts with the reference's frames, every code
offset by the codebook size (2048): they are decoded as the first frames' context and
emit no audio, as Qwen's `generate_voice_clone` decodes reference and new codes together
and cuts the reference's share.
"""

from __future__ import annotations

import torch

from omniflow.backends.cuda_graphs import Graphs
from omniflow.backends.static_decode import batch_buckets
from omniflow.backends.vocoders import (
    Decoder,
    Window,
    checked_samples_per_frame,
    field_reach,
    padded,
)
from omniflow.families.qwen3_tts.speech_tokenizer import SpeechDecoder, StateSlots, load_decoder

# The most frames (batch x window length) a captured step holds: a larger forward's kernels
# are long enough that launching them one by one costs little, and each graph's activations
# stay in the graphs' pool (a real-size step of 32 windows of 64 frames would hold GBs).
GRAPH_FRAMES = 512


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
    stateful = True
    static_windows = True

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
        self.states: StateSlots | None = None
        self.graphs: Graphs | None = None

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

    @torch.inference_mode()
    def init_states(self, slots: int) -> None:
        self.states = StateSlots(self.model, slots)

    def _stream(self, codes, slots, positions, lengths) -> torch.Tensor:
        return self.model.stream(codes, self.states, slots, positions, lengths)

    @torch.inference_mode()
    def prepare(self, lengths: list[int], max_batch: int, capture: bool) -> None:
        """Static inputs for windows of each of `lengths` frames at each batch bucket up to
        `max_batch` (at most the slots) holding up to GRAPH_FRAMES frames (one window
        always), captured as CUDA graphs when `capture`; each length's forward runs eagerly
        once, at its largest batch, before its captures (in the scratch slot: no stream's
        state is touched)."""
        self.graphs = Graphs(self.device, capture)
        self.batch_buckets = batch_buckets(min(max_batch, self.states.slots))
        self.window_lengths = sorted(lengths)
        on = {"device": self.device, "dtype": torch.int64}
        for frames in reversed(self.window_lengths):
            warmed = False
            for batch in reversed(self.batch_buckets):
                if batch > 1 and batch * frames > GRAPH_FRAMES:
                    continue
                inputs = {
                    "codes": torch.zeros(batch, self.num_codebooks, frames, **on),
                    "slots": torch.full((batch,), self.states.scratch, **on),
                    "positions": torch.zeros(batch, **on),
                    "lengths": torch.zeros(batch, **on),
                }
                self.graphs.add((batch, frames), self._stream, inputs, not warmed)
                warmed = True
        self.graphs.synchronize()

    def step(
        self, slots: list[int], positions: list[int], windows: list[Window], frames: int
    ) -> torch.Tensor:
        rows = len(windows)
        codes = padded(windows, frames, Window.codes, self.device).transpose(1, 2)
        batch = self.batch_bucket(rows)
        pad = batch - rows
        on = {"device": self.device, "dtype": torch.int64}
        values = {
            "slots": torch.tensor(slots + [self.states.scratch] * pad, **on),
            "positions": torch.tensor(positions + [0] * pad, **on),
            "lengths": torch.tensor([w.frames for w in windows] + [0] * pad, **on),
        }
        if self.graphs is not None and (batch, frames) in self.graphs:
            audio = self.graphs.run((batch, frames), {"codes": codes, **values})[:rows]
        else:  # no static window of this shape (or eager mode): the same forward, eagerly
            audio = self._stream(codes, **{k: v[:rows] for k, v in values.items()})
        return audio.reshape(rows, -1)
