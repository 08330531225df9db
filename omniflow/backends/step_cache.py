"""Step caching for the step-wise denoiser: a first-block cache, per request, in a batch.

Adjacent denoising steps of a DiT change its blocks' output little, most of all in the
middle of a schedule. A first-block cache (the idea of ParaAttention's FBCache and
cache-dit's DBCache with one front block and none behind) runs the transformer's first
block at every step and compares what it added to its input (its residual) with the same
residual at the request's last computed step: relative L1 distance
`mean |r - r_prev| / mean |r_prev|`. Under the request's `cache_threshold`, the step reuses
the residual the other blocks added at that computed step (the first block's output plus
that residual is the last block's output) and skips them; otherwise it runs them and keeps
their residual for later steps.

How it fits the step-wise backend (`DiffusionSteps`): rows of several requests, at different
steps, share one forward. The decision is per request (its conditional and unconditional
rows together, so a guided pair stays one pair): the first block runs on every row, the
other blocks on the rows of the requests that compute this step (a sub-batch), and a
reusing request's rows get their cached residual. A request's cache is its own: its
reference residual, the other blocks' residual and its counters live in its `Denoising`
(`StepState`), dropped with it.

- `cache_threshold` 0 (the default) never reuses, and a batch in which no request caches
  runs the transformer's plain forward: bit-identical to no cache. A step that reuses for
  no request runs every block on every row, as the plain forward does.
- `cache_warmup` steps at the start of each request are always computed; at most
  `cache_max_reuse` steps in a row reuse (0: no limit); the last step is always computed.
- A request whose forward group changes (a two-expert DiT passing its boundary) starts its
  cache again: the other expert's residuals say nothing of this one's.
- Where the family gives no layout (`code.cache_layout(pipe, group)` is None: a
  per-token-modulated edit DiT, attention kwargs, ...), every step is computed.

Each request counts its steps computed and reused (`Call.counters`: `steps_computed`,
`steps_reused`), which `--log-stats` prints and the profile records. What a threshold
costs in image quality depends on the weights: on random weights only the forwards saved
and the distance from the uncached image mean anything (docs/benchmarks.md, "Diffusion
and video").

The family's `CacheLayout` says where its transformer's forward may be split: the
`ModuleList` of blocks its forward runs in order, which of a block call's arguments hold
one row per batch row (by position and by name: the rest, such as rotary tables, are
shared), the block's output streams (`streams(output)` as a tuple, and `rebuild` back),
the same streams among its inputs (`inputs(args, kwargs)`), which stream is compared
(`probe`) and which get the cached residual (`cached`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from omniflow.runtime.readback import upload


@dataclass(frozen=True)
class CacheLayout:
    blocks: torch.nn.ModuleList
    row_positions: tuple[int, ...]
    row_names: tuple[str, ...]
    streams: Callable[[object], tuple[torch.Tensor, ...]]
    rebuild: Callable[[tuple[torch.Tensor, ...]], object]
    inputs: Callable[[tuple, dict], tuple[torch.Tensor, ...]]
    probe: int
    cached: tuple[int, ...]


@dataclass
class StepState:
    """One request's cache: its settings, its reference first-block residual and the other
    blocks' residual at its last computed step, and its counters."""

    threshold: float
    warmup: int
    max_reuse: int
    steps: int
    reference: torch.Tensor | None = None
    residual: tuple[torch.Tensor, ...] | None = None
    reused_in_row: int = 0
    step: int = 0
    group: object = None  # the forward group of the last step (a two-expert DiT's expert)
    last_reused: bool = False
    computed: int = 0
    reused: int = 0
    distances: list[float] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return self.threshold > 0

    def may_reuse(self) -> bool:
        """Whether this step may reuse at all (before the distance is known)."""
        return (
            self.enabled
            and self.residual is not None
            and self.step >= self.warmup
            and self.step < self.steps - 1
            and (self.max_reuse == 0 or self.reused_in_row < self.max_reuse)
        )


class StepCache:
    """The denoiser's forward, with each request's first-block cache (see the module)."""

    def __init__(self, pipe, code):
        self.pipe = pipe
        self.code = code

    def start(self, knobs: dict) -> StepState:
        return StepState(
            float(knobs.get("cache_threshold") or 0.0),
            int(knobs.get("cache_warmup") or 0),
            int(knobs.get("cache_max_reuse") or 0),
            int(knobs["steps"]),
        )

    def forward(self, group, owners, hidden, timesteps, text, mask) -> torch.Tensor:
        """The family's forward of rows owned by `owners` (each row's request state, in row
        order), reusing cached residuals where a request's cache allows."""
        states = list(dict.fromkeys(owners))  # requests, in row order
        for state in states:  # another expert's blocks: what they added says nothing here
            if state.cache.group != group:
                state.cache.group = group
                state.cache.reference = state.cache.residual = None
        layout = None
        if any(s.cache.enabled for s in states):  # their residuals are kept, for later
            layout = self.code.cache_layout(self.pipe, group)
        if layout is None:
            noise = self.code.forward(self.pipe, group, hidden, timesteps, text, mask)
            for s in states:
                self._computed(s.cache, None, None)
            return noise
        rows = {id(s): [i for i, o in enumerate(owners) if o is s] for s in states}
        split = _Split(layout, states, rows, self)
        with split.patched():
            return self.code.forward(self.pipe, group, hidden, timesteps, text, mask)

    def count(self, state, counters: dict) -> None:
        """Add this step's decision to the request's counters (`Call.counters`)."""
        key = "steps_reused" if state.cache.last_reused else "steps_computed"
        counters[key] = counters.get(key, 0) + 1

    # --- one request's bookkeeping ---
    @staticmethod
    def _computed(cache: StepState, reference, residual) -> None:
        cache.step += 1
        cache.computed += 1
        cache.reused_in_row = 0
        cache.last_reused = False
        if reference is not None:
            cache.reference, cache.residual = reference, residual

    @staticmethod
    def _reused(cache: StepState) -> None:
        cache.step += 1
        cache.reused += 1
        cache.reused_in_row += 1
        cache.last_reused = True


def distance(residual: torch.Tensor, reference: torch.Tensor) -> float:
    """Relative L1 distance of a first-block residual from the reference one."""
    scale = reference.abs().float().mean()
    change = (residual.float() - reference.float()).abs().mean()
    return float(change / scale) if scale > 0 else float("inf")


class _Split:
    """One forward with its blocks patched: the first block decides, the others run on the
    computing rows, the last one fills the reusing rows in."""

    def __init__(self, layout: CacheLayout, states, rows, cache: StepCache):
        self.layout = layout
        self.states = states
        self.rows = rows
        self.cache = cache
        self.compute: torch.Tensor | None = None  # row indexes of the computing requests
        self.first: tuple[torch.Tensor, ...] | None = None
        self.computing: list = []

    def patched(self):
        split = self

        class _Patch:
            def __enter__(self):
                blocks = split.layout.blocks
                self.saved = [block.__dict__.get("forward") for block in blocks]
                last = len(blocks) - 1
                for i, block in enumerate(blocks):
                    inner = block.forward
                    block.forward = split._wrap(inner, i, last)
                return self

            def __exit__(self, *exc):
                for block, saved in zip(split.layout.blocks, self.saved, strict=True):
                    if saved is None:
                        del block.forward
                    else:
                        block.forward = saved
                return False

        return _Patch()

    def _wrap(self, inner, index: int, last: int):
        def first(*args, **kwargs):
            out = inner(*args, **kwargs)
            self._decide(args, kwargs, out)
            return self._finish(out) if last == 0 else out

        def other(*args, **kwargs):
            if self.compute is None:  # every request computes: the plain block
                out = inner(*args, **kwargs)
                return self._finish(out) if index == last else out
            full = self.layout.inputs(args, kwargs)
            # Reusing rows pass through; the first block's output is kept (`first`), so the
            # second block writes into copies, the later ones into their own inputs.
            out = tuple(t.clone() for t in full) if index == 1 else full
            if len(self.compute):
                sub_args, sub_kwargs = self._rows(args, kwargs, self.compute)
                part = self.layout.streams(inner(*sub_args, **sub_kwargs))
                for stream, value in zip(out, part, strict=True):
                    stream[self.compute] = value
            out = self.layout.rebuild(out)
            return self._finish(out) if index == last else out

        return first if index == 0 else other

    def _rows(self, args: tuple, kwargs: dict, rows: torch.Tensor):
        args = tuple(
            a.index_select(0, rows) if i in self.layout.row_positions and torch.is_tensor(a) else a
            for i, a in enumerate(args)
        )
        kwargs = {
            k: v.index_select(0, rows) if k in self.layout.row_names and torch.is_tensor(v) else v
            for k, v in kwargs.items()
        }
        return args, kwargs

    def _decide(self, args, kwargs, out) -> None:
        layout = self.layout
        before = layout.inputs(args, kwargs)
        after = layout.streams(out)
        self.first = after
        probe = after[layout.probe] - before[layout.probe]
        compute, self.computing = [], []
        reuse_any = False
        for state in self.states:
            cache, mine = state.cache, self.rows[id(state)]
            index = upload(mine, probe.device)
            residual = probe.index_select(0, index)
            reuse = False
            if cache.may_reuse() and cache.reference.shape == residual.shape:
                d = distance(residual, cache.reference)
                cache.distances.append(d)
                reuse = d < cache.threshold
            if reuse:
                reuse_any = True
            else:
                compute += mine
                self.computing.append((state, index, residual))
        if not reuse_any:
            self.compute = None  # the plain forward for every block after
        else:
            self.compute = upload(compute, probe.device, torch.long)

    def _finish(self, out):
        """After the last block: keep the computing requests' residuals, give the reusing
        requests' rows theirs."""
        layout = self.layout
        streams = list(layout.streams(out))
        first = self.first
        for state, index, reference in self.computing:
            if not state.cache.enabled:
                StepCache._computed(state.cache, None, None)
                continue
            residual = tuple(
                (streams[k].index_select(0, index) - first[k].index_select(0, index)).clone()
                for k in layout.cached
            )
            StepCache._computed(state.cache, reference.clone(), residual)
        if self.compute is not None:
            computing = {id(s) for s, _, _ in self.computing}
            for state in self.states:
                if id(state) in computing:
                    continue
                index = upload(self.rows[id(state)], streams[0].device)
                for k, residual in zip(layout.cached, state.cache.residual, strict=True):
                    streams[k] = streams[k].index_copy(
                        0, index, first[k].index_select(0, index) + residual
                    )
                StepCache._reused(state.cache)
        return layout.rebuild(tuple(streams))
