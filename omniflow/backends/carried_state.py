"""Causal decoders that carry each stream's state from one window to the next, in fixed
per-stream slots, their steps captured per (batch bucket, window length): what a family's
stateful `Decoder` of the vocoder backend (`omniflow.backends.vocoders`) shares.

What a stream carries (`Carried`). A streamed forward decodes only a window's new frames;
each layer that looks back takes what it carried from the stream's last window and keeps
what the next window needs: each causal convolution its last `(kernel - 1) * dilation`
inputs, each transposed convolution the inputs its overlap spans, each attention layer its
keys and values of the frames its window reaches. A row at position 0 (a new stream) reads
zeros, which is what the whole-utterance decode pads with, so frames streamed in windows of
any size, one included, give the whole decode up to float rounding.

Delay. A transposed convolution that trims samples off its left (`left_trim`) makes its
output start late: from there on a window's positions are the utterance's `delay` positions
earlier than a frame-aligned window's (`Carried.delay`), and a new stream's first `delay`
positions lie before the utterance. They are zeroed before every layer that mixes positions
(the whole decode pads with zeros there), so the decode is still exact; the samples a window
emits then end `delay` samples short of its last frame, and the decoder says so as one frame
of lookahead per frame those samples span (`lag`, its `reach.lookahead`).

Where the state lives (`StateSlots`): one device buffer per carried tensor, `[slots + 1,
...]`, allocated once when the stage loads, sized by a walk of one frame through the
decoder; a stream owns a slot for its life, the last slot is scratch. A streamed forward
reads each row's state from its slot (`index_select` by a slot index tensor) and writes what
the row carries after its own last frame back into it (`index_copy_`): rows are padded on
the right to the longest, and what each keeps is taken at its own length, so padding never
reaches it. Its only inputs are the codes, slot indices, positions and lengths, and its
state buffers never move: a CUDA graph captures it.

Static windows (`StatefulDecoder.prepare`, the stage's decode "graphs", the default on CUDA).
A step is captured as a CUDA graph per (batch bucket, window length): batch buckets 1, 2, 4,
then multiples of 8 up to max_batch (`static_decode.batch_buckets`), window lengths those
the stage's grid makes (`Vocoder.grid_lengths`), while batch x length is at most
GRAPH_FRAMES. A step pads its rows up to its batch bucket with rows of length 0 in the
scratch slot, and its windows on the right up to the window length, and replays; captured
at load, largest first, in one pool (`cuda_graphs.Graphs`), none after. A forward without a
graph (longer than every length, or more frames than GRAPH_FRAMES) runs the same forward
eagerly at its own shape; "static" (CPU) runs the same buffers eagerly, so the CPU tests
exercise the replayed path's bookkeeping.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from omniflow.backends.cuda_graphs import Graphs
from omniflow.backends.static_decode import batch_buckets
from omniflow.backends.vocoders import Decoder, Window, padded
from omniflow.runtime.readback import upload

# The most frames (batch x window length) a captured step holds: a larger forward's kernels
# are long enough that launching them one by one costs little, and each graph's activations
# stay in the graphs' pool (a real-size step of 32 windows of 64 frames would hold GBs).
GRAPH_FRAMES = 512


def _last(x: torch.Tensor, ends: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """Per row b, the `n` positions of `x` along `dim` that end at `ends[b] + n`: the last n
    before a row's end, in an `x` that starts with n carried positions."""
    shape = [1] * x.dim()
    shape[0], shape[dim] = len(ends), n
    index = (ends[:, None] + torch.arange(n, device=x.device)).view(shape)
    sizes = list(x.shape)
    sizes[dim] = n
    return x.gather(dim, index.expand(sizes))


class Carried:
    """A streamed forward's walk through what its rows carry. Each layer that looks back, in
    forward order, `take`s its carried tensor `[B, ...]` (rows at position 0: zeros) and
    keeps what the next window needs (`keep_last`), written into each row's slot. `frames`:
    frames each row decoded before (its position); `lengths`: its new frames (rows are
    padded on the right to the longest); `per_frame`: positions per frame where the walk is
    (transposed convolutions multiply it); `delay`: how many positions earlier than its
    frames' a window starts there (transposed convolutions that trim their left add to it).
    With `states` None, the walk that sizes the slots: zeros in, each carried tensor's shape
    recorded."""

    def __init__(
        self,
        states: StateSlots | None,
        slots: torch.Tensor | None,
        frames: torch.Tensor,
        lengths: torch.Tensor,
    ):
        self.states, self.slots = states, slots
        self.frames, self.lengths = frames, lengths
        self.started = frames > 0
        self.per_frame = 1
        self.delay = 0
        self._taken = self._kept = 0  # carried tensors taken and kept so far
        self.shapes: list[torch.Tensor] = []

    def take(self, like: torch.Tensor, *shape: int) -> torch.Tensor:
        if self.states is None:
            zeros = like.new_zeros((len(self.frames), *shape))
            self.shapes.append(zeros)
            return zeros
        taken = self.states.buffers[self._taken].index_select(0, self.slots)
        self._taken += 1
        started = self.started.view(-1, *[1] * len(shape))
        return torch.where(started, taken, torch.zeros((), dtype=taken.dtype, device=taken.device))

    def keep_last(self, x: torch.Tensor, n: int, dim: int = -1) -> None:
        """Keep each row's last `n` positions of `x` along `dim` (`x` starts with the n it
        took) up to its own end, in its slot."""
        if self.states is None:
            return
        kept = _last(x, self.lengths * self.per_frame, n, dim % x.dim())
        self.states.buffers[self._kept].index_copy_(0, self.slots, kept)
        self._kept += 1

    def before_start(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """`x` with the positions along `dim` that lie before its row's utterance (a new
        stream's first `delay`) zeroed."""
        if not self.delay:
            return x
        dim %= x.dim()
        shape = [1] * x.dim()
        shape[0], shape[dim] = len(self.frames), x.shape[dim]
        position = torch.arange(x.shape[dim], device=x.device)
        inside = self.started[:, None] | (position[None] >= self.delay)
        return torch.where(inside.view(shape), x, torch.zeros((), dtype=x.dtype, device=x.device))

    def extend(self, x: torch.Tensor, n: int, dim: int = -1) -> torch.Tensor:
        """`x` after the `n` positions along `dim` its row carried (positions before the
        utterance zeroed); its last `n` up to the row's end are kept for the next window."""
        x = self.before_start(x, dim)
        shape = list(x.shape[1:])
        shape[dim % x.dim() - 1] = n
        x = torch.cat([self.take(x, *shape), x], dim)
        self.keep_last(x, n, dim)
        return x

    def causal_conv(self, conv: nn.Conv1d, x: torch.Tensor, padding: int) -> torch.Tensor:
        """A stride-1 convolution padded `padding` on the left, over the window's positions."""
        if conv.stride[0] != 1:
            raise ValueError("a strided causal convolution cannot stream")
        return conv(self.extend(x, padding)) if padding else conv(x)

    def transposed_conv(
        self, conv: nn.ConvTranspose1d, x: torch.Tensor, left_trim: int = 0
    ) -> torch.Tensor:
        """A transposed convolution whose whole-utterance output is cut `left_trim` samples on
        the left (and its overhang on the right): `stride` outputs per window position."""
        kernel, stride = conv.kernel_size[0], conv.stride[0]
        overlap = -(-(kernel - stride) // stride)  # inputs before the window it overlaps
        length = x.shape[-1]
        if overlap:
            x = self.extend(x, overlap)
        self.per_frame *= stride
        self.delay = self.delay * stride + left_trim
        start = overlap * stride
        return conv(x)[..., start : start + length * stride]


class StateSlots:
    """Every stream's carried state, in buffers allocated once: for each tensor a layer
    carries (in forward order), `[slots + 1, ...]`. A stream owns slot s from its first
    window to its end; the last slot is scratch, which a batch's padding rows read and
    write. Nothing in a slot is reset when a stream takes it: a row at position 0 reads
    zeros instead (`Carried.take`)."""

    def __init__(self, decoder: StatefulDecoder, slots: int):
        on = {"dtype": torch.int64, "device": decoder.device}
        one = torch.ones(1, **on)
        walk = Carried(None, None, one - 1, one)
        decoder.carried_forward(torch.zeros(1, decoder.num_codebooks, 1, **on), walk)
        self.slots = slots
        self.scratch = slots
        self.buffers = [t.new_zeros((slots + 1, *t.shape[1:])) for t in walk.shapes]


class StatefulDecoder(Decoder, ABC):
    """A causal `Decoder` that carries each stream's state in its slot (`stateful`): a
    family gives `carried_forward` (and `device`); slots, static windows and steps are here.
    """

    stateful = True
    static_windows = True
    device: str
    states: StateSlots | None = None

    @abstractmethod
    def carried_forward(self, codes: torch.Tensor, carried: Carried) -> torch.Tensor:
        """The audio `[B, ..., T * samples_per_frame]` of codes `[B, codebooks, T]`, the
        frames after those each row decoded before, through `carried`; device work only, at
        the inputs' shapes (what a CUDA graph captures)."""

    @torch.inference_mode()
    def init_states(self, slots: int) -> None:
        self.states = StateSlots(self, slots)

    def _stream(self, codes, slots, positions, lengths) -> torch.Tensor:
        return self.carried_forward(codes, Carried(self.states, slots, positions, lengths))

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
        # Sent without waiting for the stream's queued steps (a pageable copy would).
        values = {
            "slots": upload(slots + [self.states.scratch] * pad, self.device, torch.int64),
            "positions": upload(positions + [0] * pad, self.device, torch.int64),
            "lengths": upload([w.frames for w in windows] + [0] * pad, self.device, torch.int64),
        }
        if self.graphs is not None and (batch, frames) in self.graphs:
            audio = self.graphs.run((batch, frames), {"codes": codes, **values})[:rows]
        else:  # no static window of this shape (or eager mode): the same forward, eagerly
            audio = self._stream(codes, **{k: v[:rows] for k, v in values.items()})
        return audio.reshape(rows, -1)


def sliding_window(
    carried: Carried | None, t: int, window: int, device
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Causal attention over `window` frames (each frame and the `window - 1` before it), for
    `t` frames: the whole utterance's, or (`carried`) each row's next, after the `past =
    window - 1` frames whose keys and values it carries (`Carried.extend`). Returns the
    queries' positions in their utterance `[B or 1, t]`, the mask `[B or 1, 1, t, past + t]`
    (keys before the utterance, carried zeros, masked out) and `past`."""
    new = torch.arange(t, device=device)
    first = carried.frames[:, None] if carried is not None else new.new_zeros(1, 1)
    past = window - 1 if carried is not None else 0
    q = first + new
    keys = torch.cat([first - past + torch.arange(past, device=device), q], 1)
    k, query = keys[:, None, None, :], q[:, None, :, None]
    return q, (k <= query) & (k > query - window) & (k >= 0), past
