"""Decode over a static KV cache, replayed from CUDA graphs: the `ar` stage's decode step
when `decode` is "graphs" (the default on CUDA) or "static" (the same step, run eagerly;
CPU or CUDA).

The cache. One pair of tensors holds every layer's keys and values for every slot,
`[layers, slots, kv_heads, columns, head_dim]`, allocated once when the stage loads:
`slots` is the stage's max_batch and `columns` what one request may fill (its prompt plus
its max_tokens, within the budget the compiler gave the stage; `cache_columns`). A running
request owns one slot, and the backend keeps its rows compact: the request in row i is in
slot i, and when one leaves, the last row's slot moves into the hole (one copy of that
request's filled columns). A slot's column j holds position j of its request: nothing is
left-padded, and a row's attention mask is `column <= its length`.

Everything a step reads or writes lives in per-slot device buffers: each row's length (the
column its new key goes to), position offset, last sampled id, sampling parameters (those
of `omniflow.kernels.sampling`: temperature, top-k, top-p, repetition penalty, seed, step)
and seen mask, whether it advances this step, the extra input embedding its component adds
to the last id's (the talker's text-side row), and the outputs: sampled ids, last hidden
states, input embeddings. The step itself (`_run`) is pure device work: embed the last
ids, run the decoder's layers (the model's own modules: norms, projections, MLPs, its
rotary embedding) with the keys scattered into the slot's next column and attention over
the first T columns, the head, the fused sampler, then advance the rows that were active
(last id, length, step, seen). The host writes which rows advance, reads back the ids, and
nothing else crosses, both through pinned host buffers allocated once (IN_FLIGHT turns of
them, `omniflow.runtime.readback.HostCopies`). `launch` queues a step and returns at once:
the step's ids are copied without blocking into its turn's host buffers and an event
recorded after the copies on the current stream, the stage's own; the step's read-back
(`Launched`, a `HostCopy`) asks that event whether they have arrived, `landed`, without
waiting; `wait` reads them. The backend launches step t+1 before it handles step t's ids,
so the host's work of a step runs while the device computes the next one, and it reads
step t's ids only once they have landed: until then it returns to the executor's loop,
which drives the other stages of the process meanwhile (a host wait would stall them all).

Buckets. A step runs at a batch bucket B >= the number of rows (1, 2, 4, then multiples of 8
up to max_batch, as vLLM pads) and a length bucket T: rows past the live ones and rows not
advancing this step compute and are discarded. The fused step on CUDA attends through the
`decode_attention` kernel, which reads each row's filled columns on the device, so its one
length is the whole cache (`reads_lengths`) and a batch bucket has one step graph; torch's
attention (the unfused step, and off CUDA) takes the columns it reads as a shape, so there T
exceeds the longest active row's length (powers of two from 128, then `columns`). On an H100
the kernel was 1.04-5.3x faster than the bucketed SDPA at the talker's and thinker's shapes
(5.3x on 4,000-column rows at batch 1) but for the thinker's 100-column rows at batch 1 and
16, 0.6 us a layer slower (benchmarks/decode_attention.py); the talker's frame steps took
the same time either way, its step graphs went 66 -> 11 at max_batch 64 and its whole
capture 13.0 -> 2.3 s (benchmarks/tts_frames.py). A step is two pieces of device work queued
back to back with nothing read between them: the LM's step at (B, T) (`_run`: its layers,
each active row's key into its next column) and the step's finish at B (`_finish`: the head,
the masks, the sampler, a frame's completion, the rows' advance), which reads only B rows
and so has no length bucket. With `capture`, every (B, T) step and every B's finish is
captured into a CUDA graph at load (`capture_plan`), largest first, all in one memory pool
(the graphs never run at once), and `launch` replays its buckets' two graphs: no capture
happens after load (`captures` counts them, `dispatched` what each step replayed by kind and
key, eager or not). Without it, `launch` runs the same functions eagerly at the same shapes,
so replays and the eager step compute identical results. Capturing takes most of a stage's
load, so it runs no more than it must: an eager warm-up run before a capture only where
something has not yet run at those shapes (`capture_plan` says why each batch bucket's
shorter lengths need none), and a talker's frame once per batch bucket, in the finish, not
once per (B, T) (`capture_work` counts what that saves).

The fused step (`fused`, the default on CUDA where `fusable`): each layer's q/k/v and
gate/up projections (a sparse MoE block's shared expert's) are merged into one matrix each
(the model's own projections become views of them, so the weights are held once), and the
elementwise chains run as Triton kernels: residual add + RMSNorm
(`omniflow.kernels.rms_norm`), rotary + cache write (`rope_cache`), SiLU x up (`silu_mul`).
A decode step's few rows go through the skinny kernel (`skinny_matmul`) instead of cuBLAS:
the gate/up product with SiLU x up in its epilogue, and the o and down products split along
K into partial sums that the next norm adds up, so a layer is 6 launches and attention (~42
unfused); a shared expert's gate/up and down products are two (five op by op). Off CUDA the
step runs the model's modules op by op (`_layers`), as HF's forward does (the CPU tests run
the fused path under Triton's interpreter, `fused=True`).

Prefill. On the fused path new requests' prompts go straight into their slots: `prefill`
runs the fused layers over every prompt position at once (the prompts right-padded to the
longest, causal attention over each), the rotary kernel writing each position's key and
value into its request's slot: one forward for a batch of prompts, no DynamicCache and no
copy out of it. Prompts of text positions are padded to the next of `prefill_widths` (powers
of two from PREFILL_QUANTUM to PREFILL_CAPTURED) and their count to the next of
`prefill_batches` (the batch buckets up to PREFILL_BATCHED; PREFILL_BATCH_POSITIONS in all),
and with `capture` replayed from that (batch, width) pair's graph: a short prompt's prefill
is bound by its ~20 launches a layer (~30 us each, eagerly, for 16 prompts of Qwen3-TTS on
an H100), and each new count of rows costs an eager prefill cuBLAS's choice of kernels
again. A padding row (zeros) goes to a free slot: those after the batch's own, which are
free as rows are compact (where there are not enough, or the slots are not the next ones,
the prefill runs eagerly at its own shape); a free slot's columns are written by its next
request's prefill before any step reads them, and what a padding row leaves there is finite.
(Only where prompts may come without positions: a component whose every prompt has them,
`prompt_positions`, gets none.) Otherwise the backend prefills through the model's forward
and `join` copies that cache into the slot.

Frames. A codec LM whose step emits a frame of G codebooks (a talker: codebook 0 from its
own head, codebooks 1..G-1 from a small second decoder, the code predictor, conditioned on
the talker's hidden state) gives the static decoder a `FrameSpec` (`Component.frame_spec`),
and the step completes each row's frame on the device (`FrameCompleter`), after codebook 0
is sampled and before the rows advance: the predictor's G positions (the talker's hidden
state, codebook 0's embedding, then codebooks 1..G-2 as they are sampled) run one row a slot
(on the fused path the first two in one pass, two rows a slot: one read of the predictor's
weights for both) over a scratch KV cache of its own, `[layers, slots, kv_heads, G,
head_dim]`, allocated at load and overwritten from column 0 every frame (so nothing is
reset or moved between frames; on the fused path attending through `decode_attention`,
each row over the columns written so far); each codebook is sampled by the fused sampler
with the request's sub-stream (its seed + `SUB_SEED`, step `frame * MAX_SUB_STEPS +
codebook`: the draws `transformers_ar.sample_sub_step` makes on CUDA, so the eager and
static paths draw the same codes from the same logits), greedily where the request is
greedy, else with the spec's sampling. The frame's G codes go to a per-slot buffer that
the host reads back with the ids (one copy each a step), and the row's next input
embedding becomes the frame's summed codebook embeddings (`summed_codebooks`: codebook 0
in the LM's input embedding, the others in the spec's `tables`) in place of its last id's
embedding, plus the component's extra row as before. With `capture`, the predictor's G
positions and every sampling step are in the finish's graph, one per batch bucket,
replayed right after the talker's step graph.

First tokens. A request's first token is sampled from its prefill's last hidden state by
the device work of a step after its layers: `first` takes the prefilled rows (they joined
their slots first), runs the head, the masks and the sampler, completes their frames, and
advances them without a column (their prefill filled theirs), at the batch bucket of the
slots up to the last new one with only the new rows advancing: the step's finish, whose
graph at that batch bucket is replayed once a prefill (a batch of prompts), then one
read-back, queued as a step's is (a turn of its own host buffers) and returned at once as a
`Launched`: the backend emits the first tokens once they have landed. A first frame takes no
host sync between its sub-steps, as no later one does.

Minimum length. A component with `min_tokens` has its end ids masked while a row's step is
below its per-slot minimum (set at join), on the device; the component's `suppress` ids are
masked in every step, as on the eager path.

What the static path supports (`unsupported` says why not): decoders whose layers are the
Llama/Qwen2/Qwen3 shape (`input_layernorm`, `self_attn` with q/k/v/o projections, GQA
allowed, per-head q/k RMSNorms before the rotary allowed (Qwen3's `q_norm`, `k_norm`: on the
fused path the rotary kernel normalizes each head first), no sliding window,
`post_attention_layernorm`, `mlp`: dense and gated, or a sparse MoE block that
`omniflow.kernels.fused_moe` computes, `fused_moe.routed`: routed experts, optionally a
shared one), a final `norm`, and the default RoPE of the model's
`rotary_emb` (multimodal RoPE included: in decode its three position components are equal,
so its rotation is the plain one); beside them a decoder may hold input tables its forward
never reads when given input embeddings (a talker's text embedding, a code predictor's
codebook tables). Attention is `scaled_dot_product_attention` with the query heads of each
key/value head as its query rows, so keys and values are read once and never repeated per
query head. A MoE block runs without reading anything back to the host (transformers' own
forward reads the experts it hit), so its step is captured like a dense one: on the fused
path through the fused MoE kernels (router, align, grouped gate/up with SiLU x up, grouped
down; a shared expert through its own modules, gated by its sigmoid), op by op through
`fused_moe.fused_moe(capturable=True)` (the kernels on CUDA, gathered expert products
elsewhere). A `TappedDecoder` (`omniflow.backends.tapped_decoder`) runs as the model it
wraps, its step's hidden states `[B, 2H]`: the final ones, then its tapped layer's.
"""

from __future__ import annotations

import functools
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from omniflow.backends.cuda_graphs import capture_graph
from omniflow.backends.sampling_params import Sampling
from omniflow.backends.tapped_decoder import untapped
from omniflow.kernels import (
    decode_attention,
    fused_moe,
    rms_norm,
    rope_cache,
    silu_mul,
    skinny_matmul,
)
from omniflow.kernels import sampling as sampler
from omniflow.runtime.readback import HostCopies, HostCopy, HostTurn, upload

_DECODER_PARTS = {"embed_tokens", "layers", "norm", "rotary_emb"}
_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
_QK_NORMS = {"q_norm", "k_norm"}
_MLP_PARTS = {"gate_proj", "up_proj", "down_proj"}
# The smallest length bucket; the cache's columns are a multiple of it.
COLUMN_QUANTUM = 128
# Prompts' prefills are padded to a power of two from this width up to PREFILL_CAPTURED
# (within the cache's columns), and captured at each; a longer one runs eagerly at its own
# width, where its arithmetic outweighs its launches. Prompts prefilled together are padded
# to a batch bucket up to PREFILL_BATCHED, at widths of up to PREFILL_BATCH_POSITIONS in all
# (more run eagerly, as do prompts at positions): a bucket is a graph to capture at load.
PREFILL_QUANTUM = 16
PREFILL_CAPTURED = 1024
PREFILL_BATCHED = 16
PREFILL_BATCH_POSITIONS = 4096
# The attention kernels of an eager prefill, whose shape (prompts x width) is new at almost
# every batch of prompts: not cuDNN's, which SDPA prefers on Hopper but which builds a plan
# for each new shape (a 30 ms host stall in the step that starts a batch of 10 Qwen3-TTS
# prompts on an H100, before its first layer's attention launched).
PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Sub-steps a frame's second model may take: the stream steps of a frame's draws.
MAX_SUB_STEPS = 64
# The method that does each kind of `capture_plan`'s device work (looked up when run).
_WORK = {"prefill": "_padded_prefill", "step": "_run", "finish": "_finish"}
# Added to a request's seed for the draws of its frames' second model, so that they do not
# share the (seed, step) stream of its LM's own draws.
SUB_SEED = 0x5851F42D4C957F2D


def sub_stream(seed: int) -> int:
    """The sampler's seed for the draws of a request's frame sub-steps (its own `seed`'s
    stream is its LM's draws)."""
    return (seed + SUB_SEED) & (2**63 - 1)


def _budget(top_p: float) -> float:
    """A row's top-p budget, the probability mass its filter may drop (none at top_p 1)."""
    return 1 - top_p if top_p < 1 else 0.0


def _is_table(module: torch.nn.Module) -> bool:
    """An embedding table, or a list of them: inputs a decoder's forward never reads when
    it is given input embeddings."""
    if isinstance(module, torch.nn.ModuleList):
        return all(isinstance(m, torch.nn.Embedding) for m in module)
    return isinstance(module, torch.nn.Embedding)


def unsupported(decoder: torch.nn.Module) -> str | None:
    """Why the static path cannot run `decoder` (None: it can)."""
    decoder, _ = untapped(decoder)
    parts = {name for name, _ in decoder.named_children()}
    others = [getattr(decoder, name) for name in parts - _DECODER_PARTS]
    if not {"layers", "norm", "rotary_emb"} <= parts or not all(map(_is_table, others)):
        return f"its decoder has parts {sorted(parts)}"
    if getattr(decoder.rotary_emb, "rope_type", "default") != "default":
        return f"its RoPE is of type {decoder.rotary_emb.rope_type!r}"
    for i, layer in enumerate(decoder.layers):
        parts = {name for name, _ in layer.named_children()}
        attention = getattr(layer, "self_attn", None)
        if parts != _LAYER_PARTS:
            return f"layer {i} has parts {sorted(parts)}"
        names = {name for name, _ in attention.named_children()}
        if names not in (_ATTENTION_PARTS, _ATTENTION_PARTS | _QK_NORMS):
            return f"layer {i}'s attention has parts {sorted(names)}"
        if getattr(attention, "sliding_window", None):
            return f"layer {i} attends through a sliding window"
        if not hasattr(attention, "head_dim") or not hasattr(attention, "scaling"):
            return f"layer {i}'s attention has no head_dim or scaling"
        if not _dense(layer.mlp) and not fused_moe.routed(layer.mlp):
            return (
                f"layer {i}'s MLP is neither a dense gated one nor a sparse MoE block the"
                f" fused MoE kernels compute ({type(layer.mlp).__name__})"
            )
    return None


def _dense(mlp: torch.nn.Module) -> bool:
    """Whether `mlp` is a dense gated MLP: gate, up and down projections (and an activation)."""
    parts = {name for name, _ in mlp.named_children()}
    return _MLP_PARTS <= parts <= _MLP_PARTS | {"act_fn"}


def _is_silu(act) -> bool:
    """Whether `act` computes SiLU: asked of the function itself, since transformers' own
    activation classes (`SiLUActivation` in 5.x) are not `torch.nn.SiLU`."""
    if not callable(act):
        return False
    probe = torch.linspace(-6.0, 6.0, 97)
    return torch.equal(act(probe), torch.nn.functional.silu(probe))


def _swiglu(mlp: torch.nn.Module) -> bool:
    """Whether `mlp` is a SwiGLU MLP the skinny kernel's gated product takes: gate, up and
    down projections, SiLU, no gate/up bias."""
    if not _dense(mlp) or not _is_silu(getattr(mlp, "act_fn", None)):
        return False
    return mlp.gate_proj.bias is None and mlp.up_proj.bias is None


def fusable(decoder: torch.nn.Module) -> bool:
    """Whether the fused step (`StaticDecoder(fused=True)`) can run `decoder`: RMSNorms
    with a weight and `variance_epsilon` (q/k norms too, where the attention has them),
    SwiGLU MLPs (gate, up, down projections, SiLU, no gate/up bias) or sparse MoE blocks
    (`fused_moe.routed`: SwiGLU experts, run on the fused MoE kernels, and a SwiGLU shared
    expert where there is one)."""
    decoder, _ = untapped(decoder)
    norms = [decoder.norm]
    for layer in decoder.layers:
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        if hasattr(layer.self_attn, "q_norm"):
            norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
        mlp = layer.mlp
        if fused_moe.routed(mlp):
            mlp = getattr(mlp, "shared_expert", None)
            if mlp is None:
                continue
        if not _swiglu(mlp):
            return False
    return all(
        type(n).__name__.endswith("RMSNorm") and hasattr(n, "variance_epsilon") for n in norms
    )


def _merged(layer: torch.nn.Module) -> tuple:
    """The layer's q/k/v projections as one matrix (and bias), and its gate/up projections
    as one (for a sparse MoE block its shared expert's, or None: its experts are stacked
    already): made once, with the layer's own projections pointed at views of them, so the
    weights are held once and prefill reads the same memory."""
    merged = getattr(layer, "_omniflow_merged", None)
    if merged is not None:
        return merged
    attention, mlp = layer.self_attn, layer.mlp

    def fuse(modules, with_bias: bool):
        weight = torch.cat([m.weight for m in modules])
        bias = torch.cat([m.bias for m in modules]) if with_bias else None
        start = 0
        for m in modules:
            rows = m.weight.shape[0]
            m.weight = torch.nn.Parameter(weight[start : start + rows], requires_grad=False)
            if bias is not None:
                m.bias = torch.nn.Parameter(bias[start : start + rows], requires_grad=False)
            start += rows
        return weight, bias

    projections = [attention.q_proj, attention.k_proj, attention.v_proj]
    with torch.no_grad():
        qkv = fuse(projections, all(p.bias is not None for p in projections))
        gated = getattr(mlp, "shared_expert", mlp)
        gate_up = fuse([gated.gate_proj, gated.up_proj], False)[0] if _dense(gated) else None
    layer._omniflow_merged = (*qkv, gate_up)
    return layer._omniflow_merged


def kv_bytes_per_token(decoder: torch.nn.Module) -> int:
    """Bytes of keys and values one position of one request holds, every layer."""
    decoder, _ = untapped(decoder)
    attention = decoder.layers[0].self_attn
    weight = attention.k_proj.weight
    return 2 * len(decoder.layers) * weight.shape[0] * weight.element_size()


def batch_buckets(slots: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to and including `slots`."""
    sizes = {b for b in (1, 2, 4) if b < slots} | set(range(8, slots, 8)) | {slots}
    return sorted(sizes)


def length_buckets(columns: int) -> list[int]:
    """Powers of two from COLUMN_QUANTUM below `columns`, then `columns`."""
    sizes, size = [], COLUMN_QUANTUM
    while size < columns:
        sizes.append(size)
        size *= 2
    return [*sizes, columns]


def prefill_widths(columns: int) -> list[int]:
    """The widths prompts' prefills are padded to: powers of two from PREFILL_QUANTUM
    up to PREFILL_CAPTURED and `columns`."""
    widths, width = [], PREFILL_QUANTUM
    while width <= min(columns, PREFILL_CAPTURED):
        widths.append(width)
        width *= 2
    return widths


def _graph_key(key: tuple[int, ...]) -> tuple[int, int] | int:
    """A `Capture` key as its graph's dict keys it: a step's (batch, length) pair and a
    prefill's (batch, width) pair as they are, a finish's one number (its batch) alone."""
    return key if len(key) > 1 else key[0]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _leading(slots: list[int]) -> bool:
    """Whether `slots` are the first len(slots) slots in order, as in the steady state (rows
    are compact and every row advances): their buffers' rows are then a slice, and the step
    needs no index made in pinned memory and copied to the device (~36 us of the talker's
    host time a step, profiled on an H200 host)."""
    return all(slot == i for i, slot in enumerate(slots))


def _project(x, weight, bias=None, *, gated: bool = False, split: bool = False):
    """The q/k/v, o, gate/up and down projections of the fused step: a decode step's
    few rows through the skinny kernel (split into partial sums where the next kernel, a
    residual add + RMSNorm, adds them up; gated: SwiGLU's activation on the merged gate/up
    products), prefill's many through cuBLAS. (q/k/v too since dependent launch chains the
    skinny kernel to its neighbours: a Qwen3-TTS frame 4.32 -> 4.21 ms at batch 1 and 4.78
    -> 4.46 at 16 on an H100, the thinker's step unchanged.)"""
    if x.shape[0] > skinny_matmul.ROWS:
        product = F.linear(x, weight, bias)
        return silu_mul.silu_mul_triton(product) if gated else product
    most = rms_norm.most_parts(weight.shape[0]) if split else 1
    splits = skinny_matmul.split_count(x, weight, most)
    return skinny_matmul.skinny_matmul_triton(x, weight, bias, gated=gated, splits=splits)


def _swiglu_mlp(gate_up, mlp: torch.nn.Module, x, split: bool = False):
    """A SwiGLU MLP's output over rows `x` from its merged `gate_up` weight and its down
    projection (`_project`: split into partial sums where `split`)."""
    down = mlp.down_proj
    return _project(_project(x, gate_up, gated=True), down.weight, down.bias, split=split)


# A queued step's (or first tokens') read-back (runtime/readback.py): its ids `[rows]` are
# the copy's `value` and, with frames, its codes `[rows, G]` its `more`.
Launched = HostCopy


@dataclass(frozen=True)
class Capture:
    """One graph of `StaticDecoder.capture_plan`: its kind ("prefill": prompts' at buckets
    key = (batch, width); "step": the LM's step at buckets key = (batch, length); "finish":
    a step's sampling, frames and advance at batch bucket key[0]), and whether an eager run
    precedes its capture."""

    kind: str
    key: tuple[int, ...]
    warm_up: bool


@dataclass(frozen=True)
class CaptureWork:
    """Positions run at load to capture a static decoder's graphs (a prefill's counted as
    one), the captures' and the warm-ups' apart, and the same for the design
    before the split, which captured the whole step, the LM's position and the frame's
    G positions, at every (batch, length) bucket and a first step's frame at every batch
    bucket, each after a warm-up."""

    graphs: int
    warm_ups: int
    captured: int  # positions captured
    warmed: int  # positions run eagerly first
    whole_step_captured: int
    whole_step_warmed: int

    @classmethod
    def of(cls, plan: list[Capture], groups: int) -> CaptureWork:
        size = {"prefill": 1, "step": 1, "finish": groups}
        steps = sum(c.kind == "step" for c in plan)
        captured = sum(size[c.kind] for c in plan)
        before = captured + steps * groups
        warmed = sum(size[c.kind] for c in plan if c.warm_up)
        warm_ups = sum(c.warm_up for c in plan)
        return cls(len(plan), warm_ups, captured, warmed, before, before)

    def line(self) -> str:
        """What it saves, said in a line."""
        now, then = self.captured + self.warmed, self.whole_step_captured + self.whole_step_warmed
        return (
            f"{self.graphs} graphs, {self.warm_ups} warmed up: {self.captured} positions"
            f" captured + {self.warmed} warmed = {now} (whole steps: {self.whole_step_captured}"
            f" + {self.whole_step_warmed} = {then}; {then - now} fewer)"
        )


class DecoderCache:
    """A decoder's layers run one row a slot over a static KV cache `[layers, slots,
    kv_heads, columns, head_dim]`: the model's own modules op by op, or the fused kernels
    (`fused`; see the module docstring). What `StaticDecoder`'s step and its
    `FrameCompleter`'s predictor both run. A `TappedDecoder`'s hidden states carry its
    tapped layer's after the final ones (`[B, 2H]`), as its forward's do."""

    def __init__(self, decoder: torch.nn.Module, *, slots: int, columns: int, device, fused):
        decoder, self.tap = untapped(decoder)
        self.layers = list(decoder.layers)
        self.norm, self.rotary = decoder.norm, decoder.rotary_emb
        attention = self.layers[0].self_attn
        self.head_dim = attention.head_dim
        self.q_heads = attention.q_proj.weight.shape[0] // self.head_dim
        self.kv_heads = attention.k_proj.weight.shape[0] // self.head_dim
        self.scaling = attention.scaling
        self.slots, self.columns, self.device = slots, columns, torch.device(device)
        self.fused = fused
        # Whether the fused step attends through `decode_attention`, which reads each row's
        # filled columns on the device, over the whole cache (`StaticDecoder`'s `bucketed`).
        self.reads_lengths = False
        self.merged = [_merged(layer) for layer in self.layers] if fused else []
        # Which layers are sparse MoE blocks: where fused, `fusable` has made sure each layer
        # is one or a dense SwiGLU MLP (no second probe of the routers).
        self.routed = [not _dense(layer.mlp) for layer in self.layers] if fused else []
        with torch.inference_mode():
            shape = (len(self.layers), slots, self.kv_heads, columns, self.head_dim)
            dtype = attention.k_proj.weight.dtype
            self.keys = torch.zeros(shape, dtype=dtype, device=self.device)
            self.values = torch.zeros(shape, dtype=dtype, device=self.device)
            self.columns_index = torch.arange(columns, device=self.device)

    def move_columns(self, source: int, target: int, filled: int) -> None:
        """Copy slot `source`'s first `filled` columns of keys and values to slot `target`."""
        self.keys[:, target, :, :filled].copy_(self.keys[:, source, :, :filled])
        self.values[:, target, :, :filled].copy_(self.values[:, source, :, :filled])

    def decode(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        filled: torch.Tensor,
        length: int,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One position of slots 0..B-1: inputs `x` `[B, H]` (what the layers take) at
        rotary `positions` `[B]` (or their cos and sin `[B, d]`, `rotary`, where made
        before), each row's key and value written to column `filled[b]` of its slot,
        attending over the columns <= it among the first `length`. Returns the final hidden
        states `[B, H]`. Device work only.

        With `slots` (`[B]`; the fused step reading lengths only) row b is of slot
        `slots[b]`, and several rows may be one slot's positions at different columns: a
        layer writes every row's key and value before any row attends, so each sees its
        slot's columns up to its own as a step per position would have left them."""
        if slots is not None and not self.reads_lengths:
            raise ValueError("rows naming their slots need the fused step reading lengths")
        cos, sin = rotary if rotary is not None else self._rotary(x, positions)
        if self.fused:
            return self._decode_fused(x, cos, sin, filled, length, slots)
        return self._decode_layers(x, cos, sin, filled, length)

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor):
        """cos, sin `[B, d]` of each row's position."""
        cos, sin = self.rotary(x[:, None], positions[:, None])
        if cos.dim() == 4:  # multimodal RoPE's three (equal) position components
            cos, sin = cos[0], sin[0]
        return cos[:, 0], sin[:, 0]

    def _attend(self, q, keys, values, mask):
        """q `[B, kv_heads, group, d]` against keys/values `[B, kv_heads, T, d]`."""
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling)

    def _decode_fused(self, x, cos, sin, filled, length: int, slots=None) -> torch.Tensor:
        b, d, group = x.shape[0], self.head_dim, self.q_heads // self.kv_heads
        if not self.reads_lengths:
            visible = self.columns_index[:length][None] <= filled[:, None]
            mask = torch.where(visible, 0.0, -math.inf).to(x.dtype)[:, None, None]

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            q = q.view(b, self.kv_heads, group, d)
            if self.reads_lengths:  # each row over its own columns, read on the device
                out = decode_attention.decode_attention(
                    q, self.keys[i], self.values[i], filled, self.scaling, slots
                )
            else:
                keys, values = self.keys[i, :b, :, :length], self.values[i, :b, :, :length]
                out = self._attend(q, keys, values, mask)
            return out.reshape(b, self.q_heads * d)

        return self._fused(x, cos, sin, filled, attend, slots)

    def _fused(self, x, cos, sin, columns, attend, slots=None) -> torch.Tensor:
        """The decoder on the fused kernels over rows `x` `[N, H]` (at rotary `cos`, `sin`
        `[N, d]`): per layer, add + norm, one q/k/v product, (q/k norms and) rotary + the
        write of each row's key and value into column `columns[r]` of slot r (`slots[r]`
        where given), attention (`attend(layer, q)`: `[N, Hq * d]`), o projection, add +
        norm, one gate/up product and SiLU x up, down projection (`_project`). Returns the
        final hidden states `[N, H]`."""
        residual, delta, tapped = x, None, x
        for i, layer in enumerate(self.layers):
            qkv_weight, qkv_bias, gate_up = self.merged[i]
            norm, attention = layer.input_layernorm, layer.self_attn
            h, residual = rms_norm.add_rms_norm_triton(
                residual, delta, norm.weight, norm.variance_epsilon
            )
            if i == self.tap:  # (the residual stream: layer i - 1's output)
                tapped = residual
            q = rope_cache.rope_cache_triton(
                _project(h, qkv_weight, qkv_bias), cos, sin, columns, self.keys[i],
                self.values[i], self.q_heads, self.kv_heads, slots, *_qk_norms(attention),
            )  # fmt: skip
            norm, o_proj = layer.post_attention_layernorm, attention.o_proj
            h, residual = rms_norm.add_rms_norm_triton(
                residual,
                _project(attend(i, q), o_proj.weight, o_proj.bias, split=True),
                norm.weight,
                norm.variance_epsilon,
            )
            if self.routed[i]:  # a sparse MoE block: the fused MoE kernels
                # (its k weighted outputs unsummed where the next norm can add them; its
                # shared expert's products, where it has one, on the skinny kernel)
                summed = layer.mlp.gate.top_k > rms_norm.most_parts(h.shape[1])
                shared = None
                if gate_up is not None:
                    shared = functools.partial(_swiglu_mlp, gate_up, layer.mlp.shared_expert)
                delta = fused_moe.moe_forward(
                    layer.mlp, h, moe=fused_moe.fused_moe_triton, summed=summed, shared=shared
                )
            else:
                delta = _swiglu_mlp(gate_up, layer.mlp, h, split=True)
        hidden, _ = rms_norm.add_rms_norm_triton(
            residual, delta, self.norm.weight, self.norm.variance_epsilon
        )
        return self._with_tap(hidden, tapped)

    def _with_tap(self, hidden: torch.Tensor, tapped: torch.Tensor) -> torch.Tensor:
        """The final hidden states, then (a `TappedDecoder`'s) its tapped layer's: `tapped`
        where the tap is inside the stack, the final states at or past its end."""
        if self.tap is None:
            return hidden
        if self.tap >= len(self.layers):
            tapped = hidden
        return torch.cat((hidden, tapped.to(hidden.dtype)), dim=-1)

    def _decode_layers(self, x, cos, sin, filled, length: int) -> torch.Tensor:
        """The decoder through the model's own modules (norms, projections, MLPs), op by op
        as HF's forward runs them."""
        b, d = x.shape[0], self.head_dim
        group = self.q_heads // self.kv_heads
        x = x[:, None]  # [B, 1, H]
        cos, sin = cos[:, None, None], sin[:, None, None]  # [B, 1, 1, d]
        mask = (self.columns_index[:length][None] <= filled[:, None])[:, None, None]
        where = filled.clamp(max=self.columns - 1).view(b, 1, 1, 1)
        where = where.expand(b, self.kv_heads, 1, d)
        tapped = x
        for i, layer in enumerate(self.layers):
            if i == self.tap:
                tapped = x
            attention = layer.self_attn
            h = layer.input_layernorm(x)
            q = attention.q_proj(h).view(b, 1, self.q_heads, d)
            k = attention.k_proj(h).view(b, 1, self.kv_heads, d)
            if hasattr(attention, "q_norm"):  # Qwen3: each head normalized before the rotary
                q, k = attention.q_norm(q), attention.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = attention.v_proj(h).view(b, 1, self.kv_heads, d).transpose(1, 2)
            q = (q * cos) + (_rotate_half(q) * sin)
            k = (k * cos) + (_rotate_half(k) * sin)
            keys, values = self.keys[i, :b], self.values[i, :b]
            keys.scatter_(2, where, k)
            values.scatter_(2, where, v)
            out = self._attend(
                q.reshape(b, self.kv_heads, group, d),
                keys[:, :, :length],
                values[:, :, :length],
                mask,
            )
            x = x + attention.o_proj(out.reshape(b, 1, self.q_heads * d))
            x = x + _mlp(layer.mlp, layer.post_attention_layernorm(x))
        return self._with_tap(self.norm(x), tapped)[:, 0]

    def close(self) -> None:
        self.keys = self.values = None


def _mlp(mlp: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """A layer's MLP op by op: the module's own forward, but for a sparse MoE block, whose
    forward reads the experts it hit back to the host, `fused_moe.moe_forward` with no
    readback (the kernels on CUDA, the gathered torch products elsewhere)."""
    if _dense(mlp):
        return mlp(h)
    return fused_moe.moe_forward(mlp, h, moe=_capturable_moe)


_capturable_moe = functools.partial(fused_moe.fused_moe, capturable=True)


def _qk_norms(attention: torch.nn.Module) -> tuple:
    """The rotary kernel's q/k norm arguments: the weights and epsilon (None, None, 0.0:
    the attention has none)."""
    if not hasattr(attention, "q_norm"):
        return None, None, 0.0
    return attention.q_norm.weight, attention.k_norm.weight, attention.q_norm.variance_epsilon


@dataclass
class FrameSpec:
    """How a codec LM's step completes its frame of G codebooks on the device (its
    component's `frame_spec`; see the module docstring). Codebook 0 is the LM's own sampled
    id, fed to the predictor through the LM's input embedding."""

    predictor: torch.nn.Module  # the second decoder (layers, norm, rotary_emb): `unsupported`
    project: Callable[[torch.Tensor], torch.Tensor]  # the LM's width -> the predictor's
    tables: Sequence[torch.nn.Module]  # codebooks 1..G-1's input embeddings (the LM's width)
    heads: Sequence[torch.nn.Module]  # codebooks 1..G-1's logits from the predictor's states
    sampling: Sampling | None  # the predictor's warpers where its row samples (None: greedy)

    @property
    def groups(self) -> int:
        return len(self.heads) + 1


def summed_codebooks(first: torch.nn.Module, tables: Sequence[torch.nn.Module], codes):
    """`[N, D]`: each frame's codebook embeddings summed, codebook 0 in the LM's table
    `first`, codebook g >= 1 in `tables[g - 1]`: a talker's next input from frames `codes`
    `[N, G]`, where `first` is the LM's input embedding and `tables` its `FrameSpec`'s."""
    total = first(codes[:, 0])
    for g, table in enumerate(tables, start=1):
        total = total + table(codes[:, g])
    return total


def _rows_of(table: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """An embedding table's rows `ids` (the same rows either way): several gathered by
    indexing its weight, as the module's `index_select` takes a kernel for a few wide rows
    that was 15 us for 16 rows of 2,048 on an H100 where the gather took 1.7; a lone row
    through the module (1.8 us, the gather's kernel for it 3.8); a table that is no plain
    `nn.Embedding` runs its own forward."""
    if ids.shape[0] > 1 and type(table) is torch.nn.Embedding and table.max_norm is None:
        return table.weight[ids]
    return table(ids)


def _sampling_params(owner, b: int, step: torch.Tensor) -> sampler.Params:
    """The fused sampler's parameters over the first `b` rows of `owner`'s per-slot buffers
    (temperature, top_k, top_p, budget, penalty, seed), drawing at `step`: views, so a
    captured step reads what the host last wrote into them."""
    return sampler.Params.of_buffers(
        temperature=owner.temperature[:b],
        top_k=owner.top_k[:b],
        top_p=owner.top_p[:b],
        budget=owner.budget[:b],
        repetition_penalty=owner.penalty[:b],
        seed=owner.seed[:b],
        step=step[:b],
    )


class FrameCompleter:
    """Completes every row's frame inside the static step: the predictor's G positions
    one row a slot over a scratch cache of G columns, each codebook drawn by the fused
    sampler from the request's sub-stream; writes the frames' codes and, for the rows that
    advance, their next input embeddings (see the module docstring)."""

    def __init__(self, spec: FrameSpec, embed, *, slots: int, device, fused, use_triton: bool):
        self.spec, self.embed, self.groups = spec, embed, spec.groups
        predictor = spec.predictor
        self.cache = DecoderCache(
            predictor, slots=slots, columns=self.groups, device=device,
            fused=fused and fusable(predictor),
        )  # fmt: skip
        # Each sub-step's attention reads its rows' columns on the device (one kernel at G
        # columns, no mask to build) rather than SDPA's masked attention over a prefix (on an
        # H100 cuDNN's kernel and its memset: 6.6 us a layer at batch 1, 25 at 64).
        self.cache.reads_lengths = self.cache.fused
        self.use_triton = use_triton
        sampling = spec.sampling
        vocab = spec.heads[0].out_features
        top_p = sampling.top_p if sampling is not None else 1.0
        on = {"device": torch.device(device)}
        with torch.inference_mode():
            self.codes = torch.zeros(slots, self.groups, dtype=torch.int64, **on)
            self.input = torch.zeros(slots, embed.weight.shape[1], dtype=embed.weight.dtype, **on)
            # Per slot: the sub-stream's seed, and its temperature (0: the request is greedy).
            self.seed = torch.zeros(slots, dtype=torch.int64, **on)
            self.temperature = torch.zeros(slots, dtype=torch.float32, **on)
            # The same for every row: the spec's warpers, and each sub-step's column.
            top_k = sampling.top_k if sampling is not None else -1
            self.top_k = torch.full((slots,), top_k, dtype=torch.int32, **on)
            self.top_p = torch.full((slots,), top_p, dtype=torch.float64, **on)
            self.budget = torch.full((slots,), _budget(top_p), **on)
            self.penalty = torch.ones(slots, dtype=torch.float32, **on)
            self.scratch = (
                torch.empty(slots, 5 * vocab, dtype=torch.float32, **on) if use_triton else None
            )
            # Per sub-step g: its draws' steps `steps[g]` (frame f's at f * MAX_SUB_STEPS +
            # g, all G made by one op a frame), its column (its position too), and that
            # position's rotary cos and sin, the same every frame: made once, here.
            self.steps = torch.zeros(self.groups, slots, dtype=torch.int64, **on)
            self.offsets = torch.arange(self.groups, **on)[:, None]
            self.column = torch.arange(self.groups, **on)[:, None].expand(-1, slots).contiguous()
            like = torch.zeros(slots, 1, dtype=self.cache.keys.dtype, **on)
            self.cos_sin = [self.cache._rotary(like, self.column[g]) for g in range(self.groups)]
            # Positions 0 and 1 of every row in one pass (where the step reads lengths: rows
            # naming their slots): slot s's position p is row 2 s + p.
            self.pair_columns = self.column[:2].t().reshape(-1)
            self.pair_slots = torch.arange(slots, **on).repeat_interleave(2)
            self.pair_cos_sin = tuple(
                torch.stack(both, dim=1).reshape(2 * slots, -1)
                for both in zip(*self.cos_sin[:2], strict=True)
            )
        self.per_slot = [self.input, self.seed, self.temperature]

    @torch.inference_mode()
    def join(self, first: int, seeds: list[int], sampled: list[bool]) -> None:
        """Requests join slots `first`, `first` + 1, ...: each its sub-stream (`seeds[i]`;
        `sampled[i]`: it draws, else it is greedy). Their next inputs are their first
        frames', which the first step completes."""
        rows = slice(first, first + len(seeds))
        sampling = self.spec.sampling
        temperature = sampling.temperature if sampling is not None else 0.0
        device = self.seed.device
        self.seed[rows].copy_(upload([sub_stream(seed) for seed in seeds], device, torch.int64))
        drawn = [temperature if draws else 0.0 for draws in sampled]
        self.temperature[rows].copy_(upload(drawn, device, torch.float32))

    def complete(self, b: int, hidden, first, frame, active) -> None:
        """Slots 0..b-1's frames from the LM's final hidden states `hidden` `[b, H]` and
        sampled codebook-0 ids `first` `[b]`, as their frames number `frame` `[b]`: codes
        into `codes[:b]`, the next inputs of the rows `active` marks into `input[:b]`."""
        spec, cache = self.spec, self.cache

        def decode(x: torch.Tensor, g: int) -> torch.Tensor:  # position g, column g
            at, (cos, sin) = self.column[g, :b], self.cos_sin[g]
            return cache.decode(spec.project(x), at, at, g + 1, (cos[:b], sin[:b]))

        # The frame's next input, its codebooks' embeddings summed (`summed_codebooks`),
        # gathered from the predictor's inputs as they are made.
        embeds = _rows_of(self.embed, first)
        if cache.reads_lengths:  # positions 0 and 1 in one pass: one read of the weights
            pair = spec.project(torch.stack([hidden, embeds], dim=1).view(2 * b, -1))
            at, cos, sin = (t[: 2 * b] for t in (self.pair_columns, *self.pair_cos_sin))
            states = cache.decode(pair, at, at, 2, (cos, sin), self.pair_slots[: 2 * b])[1::2]
        else:
            decode(hidden, 0)
            states = decode(embeds, 1)
        torch.add(frame * MAX_SUB_STEPS, self.offsets, out=self.steps[:, :b])
        codes = [first]
        for g in range(1, self.groups):
            logits = spec.heads[g - 1](states)
            params = _sampling_params(self, b, self.steps[g])
            if self.use_triton:  # (it reads the logits in float32 itself)
                code, _ = sampler.sample_triton(logits, params, scratch=self.scratch[:b])
            else:
                code = sampler.reference(logits.float(), params)
            codes.append(code)
            embedded = _rows_of(spec.tables[g - 1], code)
            embeds = embeds + embedded
            if g < self.groups - 1:
                states = decode(embedded, g + 1)
        self.codes[:b].copy_(torch.stack(codes, dim=1))
        self.input[:b].copy_(torch.where(active[:, None], embeds, self.input[:b]))

    def close(self) -> None:
        self.cache.close()
        self.scratch = None


class StaticDecoder(DecoderCache):
    """A component's decode step over a static KV cache of `slots` x `columns`, eager or
    replayed from CUDA graphs (`capture`). `extra`: the component adds an extra input
    embedding to each step's (`launch` is given it). `fused`: run the step through the fused
    kernels (`omniflow.kernels.rms_norm`, `rope_cache`, `silu_mul`, with each layer's q/k/v
    and gate/up projections merged into one matrix product each); by default on CUDA where
    Triton and the model allow. `frames`: the component's `FrameSpec`, whose frames the
    step completes. See the module docstring."""

    def __init__(
        self,
        component,
        *,
        slots: int,
        columns: int,
        device: str,
        capture: bool,
        extra: bool,
        fused: bool | None = None,
        frames: FrameSpec | None = None,
        bucketed: bool | None = None,
    ):
        if columns % COLUMN_QUANTUM or columns <= 0:
            raise ValueError(f"columns must be a positive multiple of {COLUMN_QUANTUM}")
        decoder = component.decoder
        self.use_triton = torch.device(device).type == "cuda" and sampler.triton is not None
        if fused is None:
            fused = self.use_triton and fusable(decoder)
        super().__init__(decoder, slots=slots, columns=columns, device=device, fused=fused)
        self.component = component
        self.has_extra = extra
        self.batch_buckets = batch_buckets(slots)
        # Unless `bucketed` (by default: the fused step on CUDA), each row's attention reads
        # its own columns on the device (`decode_attention`): one length, the whole cache,
        # so one step graph per batch bucket (see the module docstring). Off CUDA the
        # kernel's interpreted run over every column would be slow: length buckets there.
        if bucketed is None:
            bucketed = not self.use_triton
        self.reads_lengths = fused and not bucketed
        self.length_buckets = [columns] if self.reads_lengths else length_buckets(columns)
        # The LM's step by (batch, length) bucket; a step's finish (sampling, the frames, the
        # advance) by batch bucket: a step replays both, a prefill's first tokens the finish.
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.finish_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Prompts' prefills by (batch, width) bucket: the graph and its hidden states
        # [batch, width, H].
        padded = fused and not getattr(component, "prompt_positions", False)
        self.prefill_widths = prefill_widths(columns) if padded else []
        self.prefill_batches = [b for b in self.batch_buckets if b <= PREFILL_BATCHED]
        self.prefill_buckets = [
            (b, w)
            for b in self.prefill_batches
            for w in self.prefill_widths
            if b == 1 or b * w <= PREFILL_BATCH_POSITIONS
        ]
        self.prefill_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.captures = 0  # graphs captured (all at load)
        self.warm_ups = 0  # of them, those run eagerly first (`capture_plan`)
        self.capture_seconds = 0.0  # what capturing them took, part of the stage's load
        self.replays = 0  # steps' and finishes' graphs replayed
        self.prefill_replays = 0  # prompts' prefills replayed from their graphs
        # Each piece of device work `launch`, `first` and `prefill` dispatched, by (kind, key)
        # as in `capture_plan`, replayed or (no graph captured) run eagerly at its shapes.
        self.dispatched: Counter[tuple[str, tuple[int, ...]]] = Counter()
        self._by_kind = {"prefill": self.prefill_graphs, "step": self.graphs}
        self._by_kind["finish"] = self.finish_graphs
        embed = component.embed.weight
        vocab = component.head.out_features
        hidden = self.norm.weight.shape[0] * (1 if self.tap is None else 2)
        self.frames = None
        if frames is not None:
            self.frames = FrameCompleter(
                frames, component.embed, slots=slots, device=device, fused=fused,
                use_triton=self.use_triton,
            )  # fmt: skip
        with torch.inference_mode():
            on = {"device": self.device}
            self.length = torch.zeros(slots, dtype=torch.int64, **on)
            self.offset = torch.zeros(slots, dtype=torch.int64, **on)
            self.last = torch.zeros(slots, dtype=torch.int64, **on)
            self.active = torch.zeros(slots, dtype=torch.bool, **on)
            self.extra = torch.zeros(slots, embed.shape[1], dtype=embed.dtype, **on)
            self.ids = torch.zeros(slots, dtype=torch.int64, **on)
            self.hidden = torch.zeros(slots, hidden, dtype=self.keys.dtype, **on)
            self.embeds = torch.zeros(slots, embed.shape[1], dtype=embed.dtype, **on)
            # A padded prefill's input embeddings (zeros past the prompts), as many positions
            # as its largest bucket holds (`_padded_prompts` views them), and its slots.
            positions = max((b * w for b, w in self.prefill_buckets), default=0)
            self.prompts = torch.zeros(positions, embed.shape[1], dtype=embed.dtype, **on)
            self.prompt_slots = torch.zeros(self.prefill_batches[-1], dtype=torch.int64, **on)
            self.slot_numbers = torch.arange(slots, dtype=torch.int64, **on)
            self.seen = torch.zeros(slots, vocab, dtype=torch.bool, **on)
            self.temperature = torch.zeros(slots, dtype=torch.float32, **on)
            self.top_k = torch.full((slots,), -1, dtype=torch.int32, **on)
            self.top_p = torch.ones(slots, dtype=torch.float64, **on)
            self.budget = torch.zeros(slots, dtype=torch.float32, **on)
            self.penalty = torch.ones(slots, dtype=torch.float32, **on)
            self.seed = torch.zeros(slots, dtype=torch.int64, **on)
            self.step_count = torch.zeros(slots, dtype=torch.int64, **on)
            self.min_tokens = torch.zeros(slots, dtype=torch.int64, **on)
            self.scratch = (
                torch.empty(slots, 5 * vocab, dtype=torch.float32, **on)
                if self.use_triton
                else None
            )
            suppress = tuple(component.suppress)
            self.suppress = torch.tensor(suppress, **on) if suppress else None
            # The ids masked while a row is below its minimum length (None: no minimum).
            ends = sorted(component.eos_ids) if getattr(component, "min_tokens", 0) else ()
            self.ends = torch.tensor(ends, **on) if ends else None
            # The steps' host buffers, IN_FLIGHT turns of them allocated now: while one
            # step's copies may still be queued, the next step fills the other's (see
            # `launch`; `first` takes turns of its own). Off CUDA too (`host_too`): a step's
            # ids are in buffers the next step overwrites before the backend reads them.
            self.host_copies = HostCopies(host_too=True)
            codes = (self.frames.codes,) if self.frames is not None else ()
            self.host_copies.reserve(self.active, self.ids, *codes)
        self.launches = 0
        self.first_steps = 0  # `first` calls: one a prefill
        self._per_slot = [
            self.length, self.offset, self.last, self.extra, self.seen, self.temperature,
            self.top_k, self.top_p, self.budget, self.penalty, self.seed, self.step_count,
            self.min_tokens, *(self.frames.per_slot if self.frames is not None else ()),
        ]  # fmt: skip
        if capture:
            began = time.perf_counter()
            self.capture()
            self.capture_seconds = time.perf_counter() - began

    # --- requests in and out ----------------------------------------------------------------
    @torch.inference_mode()
    def join(self, first: int, states: list[dict], kv: list | None = None) -> None:
        """Put prefilled requests in slots `first`, `first` + 1, ..., before their first
        tokens (`first` samples them): each one's per-slot state (`length`, `offset`,
        `temperature`, `top_k`, `top_p`, `repetition_penalty`, `seed`, `seen`, a `[V]` bool
        mask or None, `min_tokens`) and, unless `prefill` wrote them there (`kv` None, or
        `kv[i]` None), its keys and values (`kv[i]`: two `[layers, kv_heads, L, head_dim]`)
        into columns 0..L-1.

        The numbers go up in two host-to-device copies and land in a copy a buffer, whatever
        the count: a burst of prompts joined one `fill_` a number and slot before, ~25
        small launches a request on the host's path to its first token."""
        rows = slice(first, first + len(states))
        for slot, pair in enumerate(kv or (), start=first):
            if pair is None:
                continue
            keys, values = pair
            filled = keys.shape[2]
            self.keys[:, slot, :, :filled].copy_(keys)
            self.values[:, slot, :, :filled].copy_(values)
        whole = [
            (s["length"], s["offset"], s["top_k"], s["seed"], s.get("min_tokens", 0))
            for s in states
        ]
        fractions = [
            (s["temperature"], s["top_p"], _budget(s["top_p"]), s["repetition_penalty"])
            for s in states
        ]
        whole = upload(whole, self.device, torch.int64)
        fractions = upload(fractions, self.device, torch.float64)
        # (`copy_` casts to each buffer's dtype as `fill_` with the Python number did)
        for j, buffer in enumerate(
            (self.length, self.offset, self.top_k, self.seed, self.min_tokens)
        ):
            buffer[rows].copy_(whole[:, j])
        for j, buffer in enumerate((self.temperature, self.top_p, self.budget, self.penalty)):
            buffer[rows].copy_(fractions[:, j])
        self.last[rows].zero_()
        self.step_count[rows].zero_()
        self.seen[rows].fill_(False)
        seen = [
            (slot, s["seen"])
            for slot, s in enumerate(states, start=first)
            if s.get("seen") is not None
        ]
        if seen:
            slots, masks = zip(*seen, strict=True)
            self.seen.index_copy_(0, upload(list(slots), self.device), torch.stack(masks))
        if self.frames is not None:
            seeds = [s["seed"] for s in states]
            self.frames.join(first, seeds, [s["temperature"] > 0 for s in states])

    @torch.inference_mode()
    def move(self, source: int, target: int, filled: int) -> None:
        """Move the request in slot `source` (its first `filled` columns) to slot `target`."""
        self.move_columns(source, target, filled)
        for buffer in self._per_slot:
            buffer[target].copy_(buffer[source])
        self.free(source)

    @torch.inference_mode()
    def free(self, slot: int) -> None:
        """Forget slot `slot`'s request: the padding a step computes there writes column 0."""
        self.length[slot].fill_(0)  # (not `= 0`: a blocking copy of a host scalar on CUDA)

    # --- the step ---------------------------------------------------------------------------
    def buckets(self, rows: int, longest: int) -> tuple[int, int]:
        """The (batch, length) bucket of a step over `rows` rows whose longest active row
        has `longest` columns filled."""
        batch = next(b for b in self.batch_buckets if b >= rows)
        length = next((t for t in self.length_buckets if t > longest), None)
        if length is None:
            raise ValueError(f"a row of {longest} columns has no room in {self.columns}")
        return batch, length

    @torch.inference_mode()
    def launch(
        self, rows: int, active: list[int], longest: int, extra: torch.Tensor | None = None
    ) -> Launched:
        """Queue one decode step over slots 0..rows-1, of which the slots in `active` advance
        (`extra`: their extra input embeddings, in that order), and return at once. `wait`
        gives the ids sampled for slots 0..rows-1 (those of rows not in `active` mean
        nothing), and with frames their codes; the step after it may be launched first, so
        the device runs it while the host handles this one's ids (a third launch before
        this one's `wait` would overwrite them: at most readback.IN_FLIGHT are)."""
        batch, length = self.buckets(rows, longest)
        turn = self.host_copies.turn()
        self.launches += 1
        if extra is not None:
            extra = extra.to(self.extra.dtype)
            if _leading(active):
                self.extra[: len(active)].copy_(extra)
            else:
                self.extra.index_copy_(0, upload(active, self.device), extra)
        return self._queue(turn, rows, active, batch, length)

    def _queue(self, turn: HostTurn, rows: int, active, batch: int, length: int | None) -> Launched:
        """Queue a step over slots 0..rows-1 in which the slots `active` advance: the LM's
        step at buckets (batch, length) (none: a prefill's first tokens) and the finish at
        `batch`, back to back on the stream with nothing read between them, then the copies
        of its ids (and codes) into `turn`'s host buffers. The active rows go through the
        turn's staged buffer, which the step's host-to-device copy reads: the host writes
        that buffer again only in the turn that reuses it, which starts once this step's
        read-back was taken, so after its event, recorded behind that copy, fired."""
        staged = turn.staged(self.active)
        staged.zero_()
        staged[active] = True
        self.active.copy_(staged, non_blocking=True)
        if length is not None:
            self._dispatch("step", batch, length)
        self._dispatch("finish", batch)
        if self.frames is None:
            return turn.copy(self.ids[:rows])
        return turn.copy(self.ids[:rows], self.frames.codes[:rows])

    def _dispatch(self, kind: str, *key: int) -> torch.Tensor | None:
        """One piece of device work of `capture_plan`'s `kind` at `key`: its graph replayed,
        or where none was captured its function run eagerly at the same shapes. Returns its
        output (a padded prefill's hidden states)."""
        self.dispatched[kind, key] += 1
        captured = self._by_kind[kind].get(_graph_key(key))
        if captured is None:
            return getattr(self, _WORK[kind])(*key)
        if kind == "prefill":
            graph, out = captured
            self.prefill_replays += 1
        else:
            graph, out = captured, None
            self.replays += 1
        graph.replay()
        return out

    @torch.inference_mode()
    def first(self, start: int, hidden: torch.Tensor) -> Launched:
        """Queue the first tokens of the requests that joined slots start..start+n-1 (before
        any step ran them), from their prefills' last hidden states `hidden` `[n, H]`:
        sampled, and with frames completed, on the device (see the module docstring), and
        return at once, as `launch` does: its ids are those of slots 0..start+n-1 (those
        before `start` mean nothing) and, with frames, its codes `[start + n, G]`. Each
        call takes a turn of host buffers of its own (`HostCopies.turn(own=True)`: pinned
        ones come from torch's caching host allocator, which reuses them once their copies
        are done), so any number may be in flight beside the steps'."""
        rows = start + hidden.shape[0]
        batch, _ = self.buckets(rows, 0)
        self.hidden[start:rows].copy_(hidden)
        self.first_steps += 1
        turn = self.host_copies.turn(own=True)
        return self._queue(turn, rows, slice(start, rows), batch, None)

    @staticmethod
    def wait(launched: Launched) -> tuple[list[int], torch.Tensor | None]:
        """The ids a launched step sampled and, with frames, its codes `[rows, G]` (in a host
        buffer a later step reuses), waiting for them unless they have `landed` (the backend
        reads landed ones)."""
        launched.wait()
        return launched.value.tolist(), launched.more[0] if launched.more else None

    def outputs(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The last step's hidden states `[n, H]` and input embeddings `[n, E]` of `slots`
        (copies: the buffers are overwritten by the next step)."""
        if _leading(slots):
            return self.hidden[: len(slots)].clone(), self.embeds[: len(slots)].clone()
        where = upload(slots, self.device)
        return self.hidden.index_select(0, where), self.embeds.index_select(0, where)

    @torch.inference_mode()
    def prefill(
        self, slots: list[int], embeds: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Prefill requests straight into `slots` on the fused layers: `embeds` `[B, W, E]` are
        their prompts' input embeddings, right-padded to the longest (a pad attends after
        every real position, never before one, and its keys land past its request's length,
        in columns no step reads before it overwrites them), at rotary `positions` `[B, W]`,
        or `[3, B, W]` for multimodal RoPE where `takes_positions` (None: 0..W-1). Writes
        every layer's keys and values; returns the final hidden states `[B, W, H]`. One
        forward, without a DynamicCache and the copy from it into the slots: for prompts of
        text positions padded to their (batch, width) bucket and replayed from its graph
        where one was captured (`prefill_bucket`), else eagerly at their own shape."""
        b, w = embeds.shape[:2]
        bucket = None if positions is not None else self.prefill_bucket(slots, w)
        if bucket is None:
            return self._prefill(upload(slots, self.device), embeds, positions)
        batch, width = bucket
        prompts = self._padded_prompts(batch, width)
        prompts[:b, :w].copy_(embeds)
        prompts[:b, w:].zero_()
        prompts[b:].zero_()
        # The batch's slots, then the next ones for its padding rows (free: `prefill_bucket`).
        self.prompt_slots[:batch].copy_(self.slot_numbers[slots[0] : slots[0] + batch])
        hidden = self._dispatch("prefill", batch, width)
        return hidden[:b, :w].clone()  # (the graph's buffer: the next replay overwrites it)

    def prefill_bucket(self, slots: list[int], width: int) -> tuple[int, int] | None:
        """The (batch, width) bucket of prompts of `width` positions going into `slots`, or
        None where they are not padded: not in `prefill_buckets` (wider than
        `prefill_widths`, more than `prefill_batches`, or more positions in all than
        PREFILL_BATCH_POSITIONS), not the next slots from the first, or padding rows without
        free slots to go to (those after the batch's: rows are compact)."""
        padded = next((x for x in self.prefill_widths if x >= width), None)
        batch = next((x for x in self.prefill_batches if x >= len(slots)), None)
        if (batch, padded) not in self.prefill_buckets:
            return None
        first = slots[0]
        if slots != list(range(first, first + len(slots))) or first + batch > self.slots:
            return None
        return batch, padded

    def _padded_prefill(self, batch: int, width: int) -> torch.Tensor:
        """Prompts' prefill at bucket (batch, width) (what its graph captures)."""
        return self._prefill(self.prompt_slots[:batch], self._padded_prompts(batch, width), None)

    def _padded_prompts(self, batch: int, width: int) -> torch.Tensor:
        """The padded prefill's input embeddings at bucket (batch, width): `[batch, width, E]`,
        the first batch x width positions of `prompts`."""
        return self.prompts[: batch * width].view(batch, width, -1)

    def _prefill(
        self, where: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """`prefill`'s forward into the slots `where` (on the device): device work only (what
        a padded prefill's graph captures)."""
        b, w = embeds.shape[:2]
        d, group = self.head_dim, self.q_heads // self.kv_heads
        x = self.component.project(embeds).reshape(b * w, -1)
        columns = torch.arange(w, device=self.device).repeat(b)
        if positions is None:
            rope = columns[None]
        elif positions.dim() == 3:
            rope = positions.reshape(3, 1, b * w)
        else:
            rope = positions.reshape(1, b * w)
        cos, sin = self.rotary(x[None], rope)
        if cos.dim() == 4:  # multimodal RoPE's three components, equal at text positions
            cos, sin = cos[0], sin[0]

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            """Causal attention of each prompt's positions over its slot's first w columns."""
            keys, values = (
                cache[i, :, :, :w].index_select(0, where) for cache in (self.keys, self.values)
            )
            q = q.view(b, w, self.q_heads, d).transpose(1, 2)
            with sdpa_kernel(PREFILL_ATTENTION):  # (grouped heads read in place: no copies)
                out = F.scaled_dot_product_attention(
                    q, keys, values, is_causal=True, scale=self.scaling, enable_gqa=group > 1
                )
            return out.transpose(1, 2).reshape(b * w, -1)

        slot = where.repeat_interleave(w)
        return self._fused(x, cos[0], sin[0], columns, attend, slot).view(b, w, -1)

    @functools.cached_property
    def takes_positions(self) -> bool:
        """Whether `prefill` takes multimodal RoPE positions `[3, B, W]`: the model's rotary
        embedding interleaves their three components itself (Qwen2.5-Omni's thinker's does;
        one that hands the three back for the attention to interleave, Qwen2.5-VL's, does
        not)."""
        probe = torch.zeros(3, 1, 1, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            cos, _ = self.rotary(self.norm.weight[None, None], probe)
        return cos.dim() == 3

    def _run(self, batch: int, length: int) -> None:
        """The LM's step at buckets (batch, length): device work only (what a step graph
        captures). The decoder's layers into `hidden`, each active row taking its column;
        the step's `_finish` follows."""
        b = batch
        filled = self.length[:b]
        hidden = self.decode(self._inputs(b), filled + self.offset[:b], filled, length)
        self.hidden[:b].copy_(hidden)
        self.length[:b].add_(self.active[:b])  # (nothing the finish does reads the lengths)

    def _finish(self, batch: int) -> None:
        """A step from its final hidden states `hidden[:batch]` on, at batch bucket `batch`
        (what a finish graph captures; no length bucket: the frames' predictor runs over its
        own G columns): sample, complete the frames, and advance the active rows (all but
        their length, which their LM step took, or their prefill for a first token)."""
        b = batch
        hidden = self.hidden[:b]
        self._sample(b, hidden)
        if self.frames is not None:
            frame = self.step_count[:b]
            self.frames.complete(b, hidden, self.ids[:b], frame, self.active[:b])
        self._advance(b)

    def _inputs(self, b: int) -> torch.Tensor:
        """The step's input embeddings (recorded) and their projection `[B, H]`: the last
        id's embedding (with frames, the last frame's), plus the extra row."""
        c = self.component
        embeds = self.frames.input[:b] if self.frames is not None else c.embed(self.last[:b])
        if self.has_extra:
            embeds = embeds + self.extra[:b]
        self.embeds[:b].copy_(embeds)
        return c.project(embeds)

    def _sample(self, b: int, hidden: torch.Tensor) -> None:
        """The head, the masks (suppressed ids; end ids below the minimum length) and the
        fused sampler: ids into `ids[:b]`."""
        c = self.component
        logits = c.logits(hidden)
        if self.suppress is not None:
            logits.index_fill_(1, self.suppress, -math.inf)
        if self.ends is not None:
            early = (self.step_count[:b] < self.min_tokens[:b])[:, None]
            ends = logits.index_select(1, self.ends).masked_fill(early, -math.inf)
            logits.index_copy_(1, self.ends, ends)
        params = _sampling_params(self, b, self.step_count)
        seen = self.seen[:b]
        if self.use_triton:
            sampler.sample_triton(logits, params, seen, out=self.ids[:b], scratch=self.scratch[:b])
        else:
            self.ids[:b].copy_(sampler.reference(logits, params, seen))

    def _advance(self, b: int) -> None:
        """The active rows take their sampled ids: last id, step, seen mask."""
        ids, advance, seen = self.ids[:b], self.active[:b], self.seen[:b]
        self.last[:b].copy_(torch.where(advance, ids, self.last[:b]))
        self.step_count[:b].add_(advance)
        at = ids[:, None]
        seen.scatter_(1, at, seen.gather(1, at) | advance[:, None])

    # --- capture ----------------------------------------------------------------------------
    def capture_plan(self) -> list[Capture]:
        """The graphs `capture` makes, in order (largest first, so the pool's later captures
        fit in what the earlier ones took): prompts' prefill at every (batch, width) bucket of
        `prefill_buckets`, most positions first; then per batch bucket B the LM's step at
        every length bucket T and B's finish (see the module docstring).

        Warm-ups. An eager run before a capture is there for what happens the first time
        work runs at some shapes (Triton compiles a kernel's specialisation, cuBLAS and
        cuDNN set up, lazily loaded kernels load), which must not happen inside a capture.
        At one batch bucket the steps of the different length buckets run the same kernels
        with the same specialisations: every Triton kernel of the step (norms, rotary and
        cache write, the skinny products, the MoE kernels) sees B rows and the whole
        cache's strides, never T; T reaches only torch's mask and attention, whose kernels
        do not depend on it (T is a multiple of COLUMN_QUANTUM = 128, so a Triton
        specialisation on == 1 or divisibility by 16 could not tell lengths apart either).
        So each batch bucket's step is warmed up once, at its largest T, which runs first,
        and its shorter ones are captured cold. Everything else is warmed up: the finishes
        (the sampler and the predictor specialise on B) and the prefill widths (whose row
        counts pick cuBLAS's kernels and the attention's)."""
        by_size = sorted(self.prefill_buckets, key=lambda key: (key[0] * key[1], key[0]))
        plan = [Capture("prefill", key, True) for key in reversed(by_size)]
        for batch in reversed(self.batch_buckets):
            lengths = list(reversed(self.length_buckets))
            plan += [Capture("step", (batch, t), warm_up=t == lengths[0]) for t in lengths]
            plan.append(Capture("finish", (batch,), True))
        return plan

    def capture_work(self) -> CaptureWork:
        """What `capture_plan` costs in positions run, and what it saves against a whole
        step (the LM's position and the frame) captured at every (batch, length) bucket."""
        return CaptureWork.of(self.capture_plan(), self.frames.groups if self.frames else 0)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture `capture_plan`'s graphs into one memory pool (each after an eager run
        where it says). No row is active, so no request state changes (the prefills write
        slot 0's columns, which its next request's prefill overwrites)."""
        self.active.zero_()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for c in self.capture_plan():
            run = functools.partial(getattr(self, _WORK[c.kind]), *c.key)
            graph, out = capture_graph(run, pool, stream, warm_up=c.warm_up)
            self._by_kind[c.kind][_graph_key(c.key)] = (
                (graph, out) if c.kind == "prefill" else graph
            )
            self.captures += 1
            self.warm_ups += c.warm_up
        torch.cuda.synchronize(self.device)

    def replay(self, batch: int, length: int | None = None) -> None:
        """Replay the captured step at buckets (batch, length), its LM step's graph then its
        finish's, or without `length` a first step's finish: what benchmarks time."""
        if length is not None:
            self.graphs[batch, length].replay()
        self.finish_graphs[batch].replay()

    def close(self) -> None:
        self.graphs.clear()
        self.finish_graphs.clear()
        self.prefill_graphs.clear()
        super().close()
        if self.frames is not None:
            self.frames.close()
        self.seen = self.scratch = None
