"""Vocoder stages: codec frames in, waveform out, decoded while the frames stream in.

`Vocoder` is the ("vocoder", "transformers") backend. It loads the `Decoder` its model's
family gives it (the plan's `StagePlan.family`: e.g. Qwen2.5-Omni's token2wav, or an audio
codec that transformers ships, `omniflow.families.audio_codecs`) and streams every one of
them the same way.

Streaming. Each step decodes *windows*: the frames it may now emit (the kept frames), up
to `context` frames before them (the edge's left context) and `lookahead` frames after
them, and emits only the kept frames' audio, one row of `samples_per_frame` samples per
frame. A frame is kept once its lookahead has arrived; at end of stream all the rest is.
How far a decoder looks follows from its architecture: when it loads, its real modules are
walked in forward order (kernel sizes, strides, paddings and dilations of its convolutions,
its anti-aliasing filters' lengths, attention windows) through the interval arithmetic of
receptive_field.py, in exact integers. Measuring it instead (change a frame, see which
samples change) would depend on the machine: at a field's edges the influence is small
enough that float rounding decides whether it shows. One decode at load checks that the
samples per frame are those the walk found. A decoder's default lookahead is its reach. A
decoder that looks no farther than the context and lookahead streams exactly its
whole-utterance decode, up to rounding.

Carried state. A causal decoder that says it carries each stream's state from one window to
the next (`Decoder.stateful`: convolution tails, attention caches; `init_states`, `step`)
decodes each window's new frames alone, after the state the stream's last window left:
no left context is re-decoded (the edge's `context` is not used, and the compiler plans
none), a window of n frames costs n frames of work, and the first window may be a single
frame. A stateful decoder may still look ahead (`lag` frames, its reach's lookahead: its
last samples need the frame after them, as Qwen3-Omni's code2wav's transposed convolutions
make it): it then returns each window's audio `lag` frames behind its new frames, what the
frames before them completed; a stream's last window is padded with `lag` frames past its
end, whose audio the decoder zeroes. The states live in the decoder's slots, allocated once when the stage loads, one per
stream the stage batches (its max_batch): a stream takes a free slot with its first window
and gives it back when it ends, fails or is cancelled; a stream whose first
window finds every slot taken waits for one. A step passes each row's slot and position
(frames decoded before; 0 starts a stream afresh, whatever its slot held), so the forward's
inputs are index tensors and codes, its buffers fixed: it can be captured (the stage's
`decode` "graphs", the default on CUDA where the decoder has static windows; "static" runs
the same buffers eagerly). A voice clone's reference frames (`context_frames`, sent ahead
of the stream's own off the edge's schedule) go through the decoder in one window of their
own, as soon as they are all there (while the frames after them are made), advancing the
state and emitting nothing; the windows' grid starts after them, and the first frame's
window is that frame alone (a static one, replayed where captured). Windows are padded on
the right to the longest in their forward, and the decoder takes each row's state at its
own last frame, so requests of any lengths share a forward.

Read-back. A forward's audio is copied to pinned host buffers without waiting for the GPU
(runtime/readback.py) and emitted in a later step, once its event says it has landed; a
stream's frames count as decoded (`queued`) at once and as sent (`emitted`) then. At most
IN_FLIGHT forwards are on their way; meanwhile the stage says it has work in flight, so the
executor's loop steps its other stages instead of waiting.

Windows lie on a grid, so a request's waveform does not depend on how its codes happened to
be timed (a stateful decoder's window may end short of the grid where its listener would run
dry waiting for the rest, as its producer's writer sends it: runtime/slack.py): a decoder
that is not local on one of `unit` frames, windows of one unit, then two, four and more
(`WINDOW_BLOCKS` in the model catalog, which the compiler sizes the edge's chunks by;
token2wav: see its module); a local codec on the boundaries of the chunks its edge was
planned to carry. On a whole-output edge every ready frame is one window.

Batching. A step decodes one forward: the next window of the request whose listener runs
out of audio first (the one that has played longest past what it was sent, or a request
still waiting for its first packet, earliest first), together with the next windows of
other requests no longer than it, padded to its length; the rest wait for the next step,
so a short first window never waits behind other requests' long ones, and a request far
ahead of its listener waits for those about to run dry (`order="slack"`; `"arrival"`: the
request that arrived first leads). One window per request in each forward: a request alone
decodes each window at its own length, so the same seed gives the same bits in every run
mode and order. Padding never reaches kept samples: a window is padded on the right only if
its kept frames end at least the decoder's lookahead reach before its end, else on the
left only if they start at least its context reach after its start, and never if it is
shorter than the decoder's `min_frames` (a stateful decoder's windows always are padded on
the right); a window that allows none of these (a whole short utterance) goes in a forward
of windows of its own length. A decoder with static windows
(the stage's `decode` "graphs" or "static": token2wav, code2wav, docs/backends.md) has
buffers, and on CUDA captured graphs, for the lengths the grid makes while a stream runs
(`grid_lengths`; a stateful decoder's: powers of two up to the edge's longest chunk) at
each batch bucket; a forward is padded up to the shortest such length by the same rule
where its windows allow, so a stream's last windows replay too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator

import torch

from omniflow.backends import receptive_field
from omniflow.backends.receptive_field import Field
from omniflow.backends.registry import family_code
from omniflow.catalog.components import WINDOW_BLOCKS, load_component_config
from omniflow.catalog.resolve import model_path
from omniflow.errors import OmniflowError
from omniflow.runtime.edges import chunk_end
from omniflow.runtime.readback import IN_FLIGHT, HostCopies, HostCopy, upload
from omniflow.runtime.slack import (
    Playback,
    StepTimer,
    can_wait,
    cut_short,
    makers_can_wait,
    urgent_first,
)
from omniflow.runtime.stage import Backend, Call, StageSpec


class VocoderError(OmniflowError):
    """A vocoder stage cannot load its model, or cannot decode one request's codes."""


@dataclasses.dataclass(frozen=True)
class Reach:
    """How far a decoder looks, from its architecture (`field_reach`).

    `context` and `lookahead`: frames of input before and after an output frame that its
    samples depend on (math.inf: unbounded). `min_frames`: the shortest input that decodes as
    the beginning of any longer one; shorter inputs differ (EnCodec's reflect padding, given
    no more samples than it reflects, pads them with zeros first), so they are never padded.
    """

    context: float
    lookahead: float
    min_frames: float = 1


def field_reach(field: Field) -> Reach:
    """The reach of a decoder whose waveform input frame 0 influences within `field`."""
    return Reach(receptive_field.context(field), receptive_field.lookahead(field), field.min_frames)


def checked_samples_per_frame(field: Field, decode: Callable[[int], torch.Tensor]) -> int:
    """`field.per_frame`, once `decode(frames)` (the waveform of that many frames) agrees: the
    architecture walked is the one that runs."""
    frames = field.min_frames
    samples = decode(frames).numel()
    if samples != frames * field.per_frame:
        raise VocoderError(
            f"{frames} frames decode to {samples} samples, not the {field.per_frame} per frame "
            "that the decoder's layers make"
        )
    return field.per_frame


# --- per-request streams and their windows ----------------------------------------------------


@dataclasses.dataclass
class _Stream:
    """One request's frames: those from `base` on that a future window may still need."""

    state: dict
    lookahead: int
    codes: torch.Tensor
    side: torch.Tensor | None = None  # per-frame decoder inputs beside the codes (noise)
    base: int = 0
    queued: int = 0  # frames whose audio is decoded (or that were context alone)
    emitted: int = 0  # ... and whose audio has been emitted (read back to the host)
    context: int = 0  # its first frames, context alone (a voice clone's reference's)
    context_whole: bool = False  # ... all of which have come
    opened: float = 0.0  # monotonic seconds: when its first codes arrived
    first_sent: float | None = None  # when its first audio was emitted
    backlog: bool = False  # windows ready that the last step left for later
    slot: int | None = None  # a stateful decoder's state slot, from the first window on
    decoded: int = 0  # frames a stateful decoder has decoded (reference frames too)
    producer: StepTimer = dataclasses.field(default_factory=StepTimer)  # its frames' pace

    @property
    def arrived(self) -> int:
        return self.base + len(self.codes)

    def runs_out(self, frame_s: float | None) -> float:
        """When a listener who started at the first packet has played all it was sent
        (monotonic seconds); before the first packet, when the stream opened. Without a
        frame duration, every stream counts as never sent anything: arrival order."""
        played = self.emitted - self.context  # (context frames play nothing)
        return Playback(self.opened, self.first_sent, played).runs_out(frame_s)

    def forget_before(self, frame: int) -> None:
        drop = max(0, frame - self.base)
        self.codes = self.codes[drop:]
        if self.side is not None:
            self.side = self.side[drop:]
        self.base += drop


@dataclasses.dataclass(eq=False)
class Window:
    """Frames `start:end` of a stream decoded together to emit `keep_start:keep_end`;
    `offset` is where `start` sits in the padded batch."""

    stream: _Stream
    start: int
    end: int
    keep_start: int
    keep_end: int
    offset: int = 0

    @property
    def frames(self) -> int:
        return self.end - self.start

    def codes(self) -> torch.Tensor:
        return self.stream.codes[self.start - self.stream.base : self.end - self.stream.base]

    def side(self) -> torch.Tensor:
        return self.stream.side[self.start - self.stream.base : self.end - self.stream.base]


@dataclasses.dataclass
class _Decoded:
    """A decoded forward whose audio is on its way to the host: its windows, whose calls
    they are, and the copy of its audio `[windows, frames * samples_per_frame]`."""

    windows: list[Window]
    calls: list[Call]
    audio: HostCopy
    lag: int = 0  # frames each row's audio starts before its window (a stateful decoder's)

    def kept(self, per_frame: int) -> Iterator[tuple[Window, Call, torch.Tensor]]:
        """Each window, its call and its kept audio `[kept frames, per_frame]` (its own
        memory: the host buffer is reused)."""
        for row, w, call in zip(self.audio.value, self.windows, self.calls, strict=True):
            first = (w.offset + w.keep_start - w.start + self.lag) * per_frame
            kept = row[first : first + (w.keep_end - w.keep_start) * per_frame]
            kept = kept.reshape(-1, per_frame)
            yield w, call, kept.clone() if self.audio.reused else kept.contiguous()


def padded(windows: list[Window], frames: int, part: Callable[[Window], torch.Tensor], device):
    """`[B, frames, ...]`: each window's `part` at its offset, zeros around it."""
    first = part(windows[0])
    out = torch.zeros((len(windows), frames, *first.shape[1:]), dtype=first.dtype, device=device)
    for row, window in enumerate(windows):
        out[row, window.offset : window.offset + window.frames] = part(window)
    return out


# --- decoders ----------------------------------------------------------------------------


class Decoder:
    """One architecture's decode: a padded batch of code windows -> their waveforms.

    `reach` is that of the part of the decoder that padding is not masked out of;
    `lookahead` the frames of lookahead it needs by default. `unit` None means frames decode
    exactly given the reach, so each request's ready frames merge into one window per step;
    otherwise windows follow a fixed grid of `unit` frames, which window starts and the
    context keep to.
    """

    def __init__(
        self,
        samples_per_frame: int,
        num_codebooks: int,
        codebook_size: int,
        reach: Reach,
        lookahead: int,
        unit: int | None = None,
    ):
        self.samples_per_frame = samples_per_frame
        self.num_codebooks = num_codebooks
        self.codebook_size = codebook_size
        self.reach = reach
        self.lookahead = lookahead
        self.unit = unit

    def open(self, call: Call) -> dict:
        """Per-request decoder state from the request's parameters."""
        return {}

    def side(self, state: dict, frames: int) -> torch.Tensor | None:
        """Per-frame inputs beside the codes for `frames` new frames, drawn in frame order."""
        return None

    def group(self, state: dict) -> Hashable:
        """Requests whose windows may share a forward have equal groups."""
        return None

    def context_frames(self, state: dict, chunk: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
        """A request's leading frames that are context alone (decoded before the frames
        after them, as the whole utterance would be, but emitting no audio: a voice
        clone's reference frames), marked as the decoder's codes say: the chunk's codes,
        how many of its first frames are such, and whether the context ends in it (its
        last frame, marked as last, or a frame after it is there); by default none."""
        return chunk, 0, False

    def decode(self, windows: list[Window], frames: int) -> torch.Tensor:
        """`[len(windows), frames * samples_per_frame]` float32 audio of the padded batch
        (every decoder but a stateful one, which decodes by `step`)."""
        raise VocoderError(f"{type(self).__name__} decodes only with its carried state")

    # Whether the decoder is causal and carries each stream's state from one window to the
    # next in a slot of its own (`init_states`, `step`), so that a window holds only new
    # frames.
    stateful = False

    def init_states(self, slots: int) -> None:
        """Allocate a stateful decoder's state slots, `slots` streams' at once (numbered
        0..slots-1), once: when the stage loads, before `prepare`."""
        raise VocoderError(f"{type(self).__name__} carries no state")

    def step(
        self, slots: list[int], positions: list[int], windows: list[Window], frames: int
    ) -> torch.Tensor:
        """A stateful decoder's decode of each window's frames after the `positions[b]`
        frames its stream decoded before (0: a new stream, whatever its slot held), the
        batch padded on the right to `frames`: `[len(windows), frames * samples_per_frame]`
        float32 audio, of the frames from `reach.lookahead` before each window's first on
        (the samples after what its frames complete: zeros). Slot `slots[b]` holds the
        stream's state and then its state after the window's last frame (which the padding
        after it does not reach)."""
        raise VocoderError(f"{type(self).__name__} carries no state")

    # The arithmetic `set_precision` accepts: the model's own float32, unless a decoder
    # runs more (token2wav: see its PRECISIONS).
    precisions: tuple[str, ...] = ("float32",)
    # Whether `prepare` makes static windows (the stage's decode "static" and "graphs").
    static_windows = False

    def set_precision(self, precision: str) -> None:
        """Decode in `precision`, one of `precisions`; set once, when the stage loads."""
        if precision not in self.precisions:
            raise VocoderError(
                f"{type(self).__name__} decodes in {', '.join(self.precisions)}, not {precision}"
            )

    def prepare(self, lengths: list[int], max_batch: int, capture: bool) -> None:
        """Make static windows of `lengths` frames at batch buckets up to `max_batch`, their
        decodes captured as CUDA graphs when `capture`; a forward of another shape decodes
        eagerly."""
        raise VocoderError(f"{type(self).__name__} has no static windows")

    # The static windows `prepare` made: their batch buckets and lengths (frames), and their
    # decodes (`cuda_graphs.Graphs`, which counts the graphs it captured).
    graphs = None
    batch_buckets: tuple[int, ...] | list[int] = ()
    window_lengths: tuple[int, ...] | list[int] = ()

    def batch_bucket(self, rows: int) -> int:
        """The batch a forward of `rows` windows runs at: the smallest bucket that holds them
        (`rows` itself without static windows)."""
        return next((b for b in self.batch_buckets if b >= rows), rows)

    def window_frames(self, frames: int) -> int:
        """The length a forward whose longest window has `frames` frames is padded to, where
        its windows allow: the shortest static window that long (`frames` if none)."""
        return min((n for n in self.window_lengths if n >= frames), default=frames)


def _grid(unit: int | None, schedule: list[int] | None) -> Callable[[int], int] | None:
    """Where the window that starts at frame `done` ends: on the decoder's grid of units if
    it has one, else on the boundaries of the chunks the edge was planned to carry. Either
    way a request's windows do not depend on when its frames happened to arrive, so the
    same codes decode to the same bits however the run was timed. None (a whole-output
    edge): every ready frame in one window."""
    if unit is not None:
        return lambda done: done + unit * _window_units(done // unit)
    if schedule is None:
        return None
    return functools.partial(chunk_end, schedule)


def _window_units(start: int) -> int:
    """The units of the window that starts at unit `start` on the grid WINDOW_BLOCKS lays."""
    boundary = 0
    for units in WINDOW_BLOCKS[:-1]:
        if start < boundary + units:
            return units
        boundary += units
    return WINDOW_BLOCKS[-1]


def load_decoder(spec: StageSpec, device: str) -> Decoder:
    """The decoder of the stage's model, the one its model family's code loads (called with
    the checkpoint path, the component and the device)."""
    plan = spec.plan
    loader = family_code(spec, "transformers")
    if loader is None:
        family = plan.family.name if plan.family else "no model family"
        raise VocoderError(
            f"stage '{plan.name}': {plan.model} [{plan.component}] ({family}) has no decoder "
            "omniflow can run: a model family gives a vocoder its decoder"
        )
    return loader(model_path(plan.model), plan.component, device)


# --- the backend --------------------------------------------------------------------------


class Vocoder(Backend):
    """Streams codec frames to audio; see the module docstring for windows and batching.

    Request parameters: `lookahead` (frames; default: the stage's, else what the decoder needs
    to match its whole-utterance decode), besides the decoder's own (token2wav: `speaker`, `seed`,
    `steps`, `guidance`).
    """

    def __init__(self, spec: StageSpec, device: str):
        super().__init__(spec, device)
        ports = [port for port, kind in spec.inputs.items() if kind == "codes"]
        if len(ports) != 1 or "audio" not in spec.outputs:
            raise VocoderError(
                f"stage '{spec.plan.name}': a vocoder takes one codes input and has an audio output"
            )
        if not spec.plan.model:
            raise VocoderError(f"stage '{spec.plan.name}': a vocoder needs a model")
        self.port = ports[0]
        self.decoder = load_decoder(spec, device)
        planned = tuple(spec.outputs["audio"].shape)
        if planned != (self.decoder.samples_per_frame,):
            raise VocoderError(
                f"stage '{spec.plan.name}': the plan sizes audio rows as {planned}, but "
                f"{spec.plan.model} [{spec.plan.component}] makes "
                f"{self.decoder.samples_per_frame} samples per frame"
            )
        component = load_component_config(spec.plan.model, spec.plan.component)
        self.stateful = self.decoder.stateful
        if component.carries_state and not self.stateful:
            raise VocoderError(
                f"stage '{spec.plan.name}': the plan has {spec.plan.model} "
                f"[{spec.plan.component}] carry its state from window to window (no left "
                f"context), but its decoder, {type(self.decoder).__name__}, does not"
            )
        # Frames a stateful decoder's audio lags the new frames it decodes by.
        self.lag = int(self.decoder.reach.lookahead) if self.stateful else 0
        align = self.decoder.unit or 1
        # A stateful decoder re-decodes no context: its state holds what the context would.
        context = 0 if self.stateful else spec.contexts.get(self.port, 0)
        self.context = context - context % align
        self.lookahead = spec.plan.settings.get("lookahead", self.decoder.lookahead)
        self.schedule = spec.schedules.get(self.port)
        self.grid_end = _grid(self.decoder.unit, self.schedule)
        # A stateful decoder's state slots, one per stream the stage batches at once.
        self.free_slots = list(range(max(1, spec.plan.batch))) if self.stateful else []
        if self.stateful:
            self.decoder.init_states(len(self.free_slots))
        self.decode_mode = self._static_windows(spec, device)
        # Seconds of audio a frame plays for, which slack ordering needs (None: unknown rate).
        rate = component.frame_rate
        slack = spec.plan.settings["order"] == "slack" and rate
        self.frame_s = 1 / rate if slack else None
        # Decoded forwards whose audio is on its way to the host (readback.py), oldest first.
        self.reading: deque[_Decoded] = deque()
        self.host_copies = HostCopies()

    def _static_windows(self, spec: StageSpec, device: str) -> str:
        """Set the decoder's precision and make its static windows (the grid's window lengths
        at each batch bucket) for the stage's `decode` mode, which it returns, resolved:
        "auto" is bfloat16 and "graphs" on CUDA where the decoder has them, float32 and
        "eager" elsewhere."""
        settings, name, decoder = spec.plan.settings, spec.plan.name, self.decoder
        cuda = torch.device(device).type == "cuda"
        precision = settings["precision"]
        if precision == "auto":
            precision = "bfloat16" if cuda and "bfloat16" in decoder.precisions else "float32"
        decoder.set_precision(precision)
        mode = settings["decode"]
        static = decoder.static_windows and (decoder.unit is not None or self.stateful)
        if mode == "auto":
            mode = "graphs" if cuda and static else "eager"
        if mode == "eager":
            return mode
        if not static:
            raise VocoderError(
                f"stage '{name}': decode='{mode}' needs a decoder with static windows "
                f"(token2wav), not {type(decoder).__name__}"
            )
        if mode == "graphs" and not cuda:
            raise VocoderError(f"stage '{name}': decode='graphs' needs a CUDA device, not {device}")
        began = time.perf_counter()
        decoder.prepare(self.grid_lengths(), max(1, spec.plan.batch), capture=mode == "graphs")
        if mode == "graphs":
            self.captures = decoder.graphs.captures
            self.capture_seconds = time.perf_counter() - began
        return mode

    def grid_lengths(self) -> list[int]:
        """The lengths of the windows the grid makes while a stream runs (each with its full
        lookahead and as much context as there is before it); past the context and the
        window sizes' ramp (WINDOW_BLOCKS) they repeat. The last windows of a stream are
        shorter, and are padded up to one of these where their reach allows. A stateful
        decoder's windows hold new frames only, any number up to the edge's longest chunk
        and its `lag` (a stream's first and last windows'): powers of two below that, then
        it (a stream's first window, which a voice clone's reference frames lengthen, may be
        longer: it decodes eagerly)."""
        if self.stateful:
            longest = max(self.schedule or [1]) + self.lag
            return [*(2**k for k in range(longest.bit_length()) if 2**k < longest), longest]
        unit, lookahead, lengths, done = self.decoder.unit, self.lookahead, set(), 0
        while done <= self.context + unit * sum(WINDOW_BLOCKS):
            end = self.grid_end(done)
            lengths.add(end + lookahead - max(0, done - self.context))
            done = end
        return sorted(lengths)

    def ready(self, call: Call) -> bool:
        codes, stream = call.inputs[self.port], call.state.get("stream")
        landed = bool(self.reading) and self.reading[0].audio.landed()
        if stream is not None and stream.queued > stream.emitted:
            if landed:
                return True  # its audio may be on the host: the step emits it
            if codes.ended:
                return False  # all that is left is on its way
        room = len(self.reading) < IN_FLIGHT or landed
        fresh = codes.available() or codes.ended or stream is not None and stream.backlog
        return room and fresh and not (stream is not None and self._waits(stream))

    def in_flight(self) -> bool:
        # A dropped request's audio still on its way is taken by the next step: only a live
        # request's keeps the loop polling.
        return any("stream" in call.state for d in self.reading for call in d.calls)

    def first_packet_in_flight(self) -> bool:
        return any(
            "stream" in call.state and w.stream.first_sent is None and w.keep_end > w.keep_start
            for d in self.reading
            for w, call in zip(d.windows, d.calls, strict=True)
        )

    def makers_wait_for(self) -> set[str]:
        """The live requests with a window on the device here that their makers wait for
        (slack.py): a first window, or (but for a carried-state stream) a later one its
        listener needs before it could play through and can spare the pause for. Only where
        this stage orders by slack."""
        if self.frame_s is None:
            return set()
        now = time.monotonic()
        return {
            call.request_id
            for decoded in self.reading
            for window, call in zip(decoded.windows, decoded.calls, strict=True)
            if "stream" in call.state
            and window.keep_end > window.keep_start
            and self._makers_can_wait(window, now)
        }

    def _makers_can_wait(self, window: Window, now: float) -> bool:
        stream = window.stream
        if stream.first_sent is None:
            return True
        if self.stateful:
            # Its edge keeps it fed: a chunk goes out short where the listener would run dry
            # (`_cut_short`), so a later window is a few frames at most, soon out. Pausing
            # the makers for them cost Qwen3-TTS at 16 streams an eighth of its throughput
            # and gained nothing at one (docs/benchmarks-log.md, "Held rows only where
            # their stage would launch nothing").
            return False
        frame_s = self.frame_s
        after = window.keep_end - stream.context  # the frames played once the window is sent
        played = Playback(stream.opened, stream.first_sent, after)
        # The frames the stream's next window needs past those it has: up to the grid's next
        # end (or one more frame), and the lookahead after it.
        next_end = stream.context + (after + 1 if self.grid_end is None else self.grid_end(after))
        missing = max(0, next_end + max(stream.lookahead, self.lag) - stream.arrived)
        return makers_can_wait(
            stream.runs_out(frame_s),
            (window.keep_end - window.keep_start) * frame_s,
            played.runs_out(frame_s),
            now,
            missing,
            stream.producer.step_s,
        )

    def _waits(self, stream: _Stream) -> bool:
        """Whether the stream's next window waits for a first packet on the device: its
        listener can (slack.py)."""
        if not self.first_packets_first or self.frame_s is None or stream.first_sent is None:
            return False
        return can_wait(stream.runs_out(self.frame_s), time.monotonic())

    def urgent_first(self, calls: list[Call]) -> list[Call]:
        """Slack first (`order="slack"`): requests not opened yet, then the streams whose
        listeners run dry first."""
        if self.frame_s is None:
            return calls

        def runs_out(call: Call) -> float:
            stream = call.state.get("stream")
            return -math.inf if stream is None else stream.runs_out(self.frame_s)

        return urgent_first(calls, runs_out)

    def step(self, calls: list[Call]) -> None:
        self._emit_landed()
        nexts: dict[Window, Call] = {}
        for call in calls:
            try:
                stream = self._receive(call)
            except VocoderError as err:
                call.fail(err)
                continue
            if self._waits(stream):
                continue
            if windows := self._windows(stream, call.inputs[self.port].ended):
                if self.stateful and stream.slot is None:
                    if not self.free_slots:
                        continue  # every slot is a live stream's: this one waits for one
                    stream.slot = self.free_slots.pop()
                nexts[windows[0]] = call
        if nexts and len(self.reading) < IN_FLIGHT:
            frames, batch = self._forward(list(nexts))
            audio = self._decode(batch, frames)
            for window in batch:
                window.stream.queued = window.keep_end
                window.stream.forget_before(window.keep_end - self.context)
            calls_of = [nexts[w] for w in batch]
            copy = self.host_copies.copy(audio)
            self.reading.append(_Decoded(batch, calls_of, copy, self.lag))
            self._emit_landed()  # off CUDA, at once
        for call in calls:
            if call.error is not None:
                continue
            stream, ended = call.state["stream"], call.inputs[self.port].ended
            stream.backlog = bool(self._windows(stream, ended))
            if ended and stream.emitted == stream.arrived:
                self._free_slot(stream)
                call.finish()

    def _emit_landed(self) -> None:
        """Emit the audio of the decoded forwards whose read-back has landed, oldest first
        (a stream's windows in order)."""
        while self.reading and self.reading[0].audio.landed():
            decoded = self.reading.popleft()
            now = time.monotonic()
            for window, call, audio in decoded.kept(self.decoder.samples_per_frame):
                window.stream.emitted = window.keep_end
                if not len(audio):  # a window of context alone
                    continue
                call.emit("audio", audio)
                if window.stream.first_sent is None:
                    window.stream.first_sent = now

    def drop(self, call: Call) -> None:
        """Forget the request's stream (finished, failed or cancelled); its slot is free."""
        stream = call.state.pop("stream", None)
        if stream is not None:
            self._free_slot(stream)

    def _free_slot(self, stream: _Stream) -> None:
        if stream.slot is not None:
            self.free_slots.append(stream.slot)
            stream.slot = None

    def _receive(self, call: Call) -> _Stream:
        """Open the request's stream on its first step, and append what arrived."""
        decoder = self.decoder
        stream = call.state.get("stream")
        if stream is None:
            lookahead = call.params.get("lookahead")
            lookahead = self.lookahead if lookahead is None else lookahead
            if not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 0:
                raise VocoderError(f"lookahead must be a whole number of frames, not {lookahead!r}")
            stream = _Stream(
                decoder.open(call),
                lookahead,
                torch.zeros(0, 0, dtype=torch.int64, device=self.device),
                opened=time.monotonic(),
            )
            call.state["stream"] = stream
        chunk = call.inputs[self.port].take()
        if chunk is None or not len(chunk):
            return stream
        if chunk.dim() != 2 or not 1 <= chunk.shape[1] <= decoder.num_codebooks:
            raise VocoderError(
                f"codes must be [frames, codebooks] with 1 to {decoder.num_codebooks} "
                f"codebooks, not {list(chunk.shape)}"
            )
        if chunk.is_floating_point() or chunk.is_complex():
            raise VocoderError(f"codes must be integers, not {chunk.dtype}")
        if len(stream.codes) and chunk.shape[1] != stream.codes.shape[1]:
            raise VocoderError("the number of codebooks changed within a request")
        chunk, context_only, context_ends = decoder.context_frames(stream.state, chunk)
        if context_only and stream.emitted != stream.arrived:
            raise VocoderError("context-only frames came after frames to decode")
        low, high = int(chunk.min()), int(chunk.max())
        if low < 0 or high >= decoder.codebook_size:
            raise VocoderError(
                f"code {low if low < 0 else high} is outside the codebook (0..{decoder.codebook_size - 1}); "
                "a codec LM's token ids need its codec offset subtracted"
            )
        codes = upload(chunk, self.device, torch.int64)  # (not waiting for queued steps)
        if len(codes) > context_only:  # its producer's pace: of the frames it makes
            stream.producer.add(len(codes) - context_only, time.monotonic())
        # cat copies: the chunk may be a view into a channel slot released after the step.
        stream.codes = torch.cat([stream.codes.reshape(-1, codes.shape[1]), codes])
        # Decoded as the next windows' context, never emitted.
        stream.queued += context_only
        stream.emitted += context_only
        stream.context += context_only
        stream.context_whole |= context_ends
        side = decoder.side(stream.state, len(codes))
        if side is not None:
            side = upload(side, self.device)
            stream.side = side if stream.side is None else torch.cat([stream.side, side])
        return stream

    def _windows(self, stream: _Stream, ended: bool) -> list[Window]:
        arrived, done = stream.arrived, stream.queued
        ready = arrived if ended else arrived - max(stream.lookahead, self.lag)
        if self.grid_end is None:
            spans = [(done, ready)] if ready > done else []
        else:
            spans = []
            while done < arrived:
                # The grid starts after the context: its writer sent that ahead, off it.
                end = stream.context + self.grid_end(done - stream.context)
                if end > ready and not ended:
                    if ready > done and self._cut_short(stream, end - arrived):
                        spans.append((done, ready))
                    break
                spans.append((done, min(end, arrived)))
                done = end
        if self.stateful:  # each window decodes the frames after the one before it
            windows, start = [], stream.decoded
            if start < stream.context:
                # The whole context in one window of its own, however it came (the same
                # windows, the same bits): decoded as soon as it is all there, while the
                # frames after it are made, so that the first frame's window is that frame.
                if not (stream.context_whole or ended):
                    return []
                windows.append(
                    Window(stream, start, stream.context, stream.context, stream.context)
                )
                start = stream.context
            for k0, k1 in spans:
                end = max(start, min(arrived, k1 + self.lag))
                windows.append(Window(stream, start, end, k0, k1))
                start = end
            return windows
        return [
            Window(stream, max(0, k0 - self.context), min(arrived, k1 + stream.lookahead), k0, k1)
            for k0, k1 in spans
        ]

    def _cut_short(self, stream: _Stream, missing: int) -> bool:
        """Whether a carried-state stream's window decodes the frames it has, `missing`
        short of its grid's, because its listener would run dry waiting for the rest (its
        edge is paced: its writer cuts its chunks by the same rule, slack.py). Its first
        window is never cut: that is the edge's planned first chunk."""
        plays_s = self.spec.paced.get(self.port)
        if not self.stateful or plays_s is None or stream.first_sent is None:
            return False
        slack = stream.runs_out(plays_s) - time.monotonic()
        return cut_short(slack, missing, stream.producer.step_s)

    def _forward(self, windows: list[Window]) -> tuple[int, list[Window]]:
        """The step's forward, (frames, windows at their offsets), from each request's next
        window: the most urgent one's (whose stream runs out first), padded to its decoder's
        static length where it allows, else its own; and of the others in its group, those
        no longer than that which padding to it does not reach."""
        lead = min(windows, key=lambda w: w.stream.runs_out(self.frame_s))
        group = self.decoder.group(lead.stream.state)
        others = [
            w for w in windows if w is not lead and self.decoder.group(w.stream.state) == group
        ]
        frames = self.decoder.window_frames(self._span(lead))
        if frames > self._span(lead) and not self._fit([lead], frames)[0]:
            frames = lead.frames  # a static length the lead cannot be padded to
        batch, _ = self._fit([lead, *(w for w in others if self._span(w) <= frames)], frames)
        return frames, batch

    def _span(self, w: Window) -> int:
        """The frames a forward needs for window `w`: its own, and a stateful decoder's
        stream's last window the `lag` frames after it, whose audio completes its last."""
        return max(w.end, w.keep_end + self.lag) - w.start

    def _decode(self, batch: list[Window], frames: int) -> torch.Tensor:
        """The batch's float32 audio `[len(batch), frames * samples_per_frame]`, left on
        the device; a stateful decoder's streams carry their state past their windows."""
        with torch.inference_mode():
            if self.stateful:
                slots = [w.stream.slot for w in batch]
                audio = self.decoder.step(slots, [w.stream.decoded for w in batch], batch, frames)
                for w in batch:
                    w.stream.decoded = w.end
            else:
                audio = self.decoder.decode(batch, frames)
            return audio.float()

    def _fit(self, windows: list[Window], frames: int) -> tuple[list[Window], list[Window]]:
        """The windows that may be padded to `frames` (their offsets set), and the rest."""
        reach, batch, refused = self.decoder.reach, [], []
        for w in reversed(windows):
            pad = frames - w.frames
            long_enough = w.frames >= reach.min_frames
            right = self.stateful or long_enough and w.end - w.keep_end >= reach.lookahead
            if pad == 0 or right:
                w.offset = 0  # padded on the right, if at all
            elif long_enough and w.keep_start - w.start >= reach.context:
                w.offset = pad
            else:
                refused.append(w)
                continue
            batch.append(w)
        return batch, refused
