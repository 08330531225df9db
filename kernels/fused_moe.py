"""A mixture-of-experts layer's routed experts, fused: `[T, H]` tokens, each sent to `top_k`
of `E` SwiGLU experts and the experts' outputs summed with the router's weights, as
Qwen3-Omni-30B-A3B's MoE decoder layers run it (thinker: H 2048, 128 experts, 8 a token,
expert width I 768; talker: H 1024, 128 experts, 6 a token, I 384, plus a dense shared
expert). Triton kernels on CUDA, and the torch reference (`reference`) they are tested
against. In three steps, none of which reads a value back to the host (a decode step can
be captured in a CUDA graph):

- the routing: each token's top k experts and weights (`route`), and the T x top_k
  (token, expert) entries sorted by expert, each expert's run padded to BLOCK_M rows, with
  the expert of each block of BLOCK_M rows (-1 for the blocks past the last used one, whose
  programs return at once: `align`). Both are `omniflow.kernels.moe_route`'s: one launch
  from the router's logits on CUDA where a decode step's sizes fit (T <= 64 at E = 128),
  else its torch ops (`route` ~5, `align` three at T = 1, fourteen otherwise);
- a grouped product of each block's tokens by its expert's gate/up matrix, with
  `silu(gate) * up` applied to the products in registers: the `[T k, I]` activations are
  written, never the `[T k, 2 I]` products;
- a grouped product of the activations by each expert's down matrix, its output rounded,
  times the entry's router weight, written to `[T, top_k, H]`: each token's k weighted
  expert outputs, added up by one `sum` (deterministic, no atomics), or (`summed=False`)
  left for the kernel after them to add: `omniflow.kernels.rms_norm` takes them as its
  residual `[top_k, T, H]`, as the decode step's next norm does (one launch a layer less).

Weights are taken as transformers (5.x) holds them, so nothing is copied at load: the
experts module (`Qwen3OmniMoeThinkerTextExperts`, `Qwen3OmniMoeTalkerTextExperts`) has
`gate_up_proj` `[E, 2 I, H]` (each expert's gate rows, then its up rows: the layout
`F.linear` takes) and `down_proj` `[E, H, I]`; the router (`block.gate`) has `weight`
`[E, H]`. `moe_forward(block, hidden)` runs a transformers sparse MoE block on these
kernels from the block's own parameters; `register()` also makes them a transformers
experts implementation (`experts_implementation="omniflow_fused_moe"`). `routed(block)`
says whether a block is one `moe_forward` computes (its structure, and its router's rule
probed), which is what lets the static decode step (`omniflow.backends.static_decode`) take
a MoE layer; `fused_moe(..., capturable=True)` is the path with no host readback anywhere
that a captured step runs: the kernels on CUDA, elsewhere `experts_gathered` (each entry's
expert matrices gathered and multiplied as a batch; `experts_reference`, like transformers,
reads the experts hit back to the host).

Why: at decode each token reads top_k experts' weights (the thinker's: 9.4 MB an expert,
75 MB a token) for a few rows each, so the layer is bound by how fast those weights stream.
transformers runs the experts one by one (a host sync to find the experts hit, then about
ten small kernels an expert, `index_add_` among them), or through `torch._grouped_mm` over
all E experts' offsets with the `[T k, 2 I]` products, activations and weighted outputs in
memory between kernels; here a layer's experts are three launches after the router's
linear and the routing kernel. Its speed is `benchmarks/fused_moe.py`'s to tell
(docs/benchmarks.md, "Kernels"; the runs: docs/benchmarks-log.md, "Fused MoE").

Numerics are transformers': the router's softmax in float32, its top-k weights
renormalised in float32 when `renormalize` (`norm_topk_prob`), then rounded to the logits'
dtype (`moe_route`'s kernel adds its two float32 sums in its own order: a weight within a
rounding of that, ties to the lower index; its docstring bounds both); products accumulate
in float32 (float32 inputs multiply in IEEE float32; under Triton's interpreter every input
is upcast first), gate and up rounded to the input dtype, SiLU and the product as
`omniflow.kernels.silu_mul` computes them, the down product rounded, times the weight and
rounded, as transformers' experts do. transformers then adds the k weighted outputs into a
tensor of the input dtype one expert at a time (bf16 adds); here they are summed in float32
and rounded once, as its `grouped_mm` implementation does. Sums run in another order than
cuBLAS', so results differ from `reference` by rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omniflow.errors import OmniflowError
from omniflow.kernels import moe_route, silu_mul
from omniflow.kernels.moe_route import align, block_m_for, route
from omniflow.kernels.triton_guard import dependent_launch, gdc_enter, jit, tl, triton

# A program's output columns, its K tile and depth, for both products (benchmarks/fused_moe.py
# --sweep times others); block_m (rows a block) follows the tokens an expert gets
# (`block_m_for`). Tiles sized for decode's few rows an expert.
DECODE_TILES = {"block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 4}
# A prefill's: from PREFILL_ROWS entries an expert on average (a thinker's prompt of 2,048
# tokens) the products are bound by FLOPs, not by the weights' read, and want large tiles.
# On an H100 the thinker's layer took 977 us at 2,500 tokens and 4.6 ms at 20,000 on these,
# 1,643 us and 12.0 ms on the decode tiles; `benchmarks/fused_moe.py --sweep` found nothing
# over 1.5 % faster.
PREFILL_ROWS = 128
PREFILL_TILES = {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 4}
# The name `register` gives the kernels in transformers' experts implementations.
IMPLEMENTATION = "omniflow_fused_moe"


class MoEError(OmniflowError):
    """Operands of mismatched shapes, or a MoE block the kernels do not compute."""


@jit
def _moe_matmul_kernel(
    x_ptr, w_ptr, out_ptr, scale_ptr, sorted_ptr, expert_ptr, entries, N, K, top_k,
    x_stride, w_expert_stride, w_stride, out_stride,
    GATED: tl.constexpr, IN_FLOAT32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(GDC)
    # One program: BLOCK_M sorted entries (one expert's) by BLOCK_N of its columns. Gated:
    # x is the tokens [T, K] (entry e reads row e // top_k), W the gate/up stack
    # [E, 2 N, K], out [T k, N]. Else: x is the activations [T k, K] (top_k = 1), W the down
    # stack [E, N, K], out [T k, N] with each row times its entry's weight.
    block = tl.program_id(0)
    expert = tl.load(expert_ptr + block).to(tl.int64)
    if expert < 0:  # past the last used block
        return
    rows = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_in = rows < entries  # padding holds `entries`
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_in = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (rows // top_k)[:, None] * x_stride + ks[None, :]
    w_ptrs = w_ptr + expert * w_expert_stride + cols[:, None].to(tl.int64) * w_stride + ks[None, :]
    up_offset = N.to(tl.int64) * w_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_in = ks[None, :] < K - k0
        x = tl.load(x_ptrs, mask=row_in[:, None] & k_in, other=0.0)
        w = tl.load(w_ptrs, mask=col_in[:, None] & k_in, other=0.0)
        if IN_FLOAT32:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee" if IN_FLOAT32 else "tf32")
        if GATED:
            u = tl.load(w_ptrs + up_offset, mask=col_in[:, None] & k_in, other=0.0)
            if IN_FLOAT32:
                u = u.to(tl.float32)
            up = tl.dot(x, tl.trans(u), up, input_precision="ieee" if IN_FLOAT32 else "tf32")
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = x_ptr.dtype.element_ty
    acc = acc.to(dtype).to(tl.float32)
    if GATED:
        act = (acc / (1.0 + tl.exp(-acc))).to(dtype).to(tl.float32)
        acc = act * up.to(dtype).to(tl.float32)
    else:
        scale = tl.load(scale_ptr + rows, mask=row_in, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
    out = out_ptr + rows[:, None] * out_stride + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])


def _check(hidden, w_gate_up, w_down, topk_ids, topk_weights) -> None:
    if hidden.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise MoEError(
            f"hidden must be [T, H], the weights [E, 2 I, H] and [E, H, I]: {list(hidden.shape)},"
            f" {list(w_gate_up.shape)}, {list(w_down.shape)}"
        )
    experts, inner2, width = w_gate_up.shape
    if width != hidden.shape[1] or inner2 % 2 or w_down.shape != (experts, width, inner2 // 2):
        raise MoEError(
            f"hidden {list(hidden.shape)}, gate/up {list(w_gate_up.shape)} and down"
            f" {list(w_down.shape)} do not chain as [T, H], [E, 2 I, H], [E, H, I]"
        )
    if not hidden.dtype == w_gate_up.dtype == w_down.dtype:
        raise MoEError(f"hidden is {hidden.dtype}, the weights {w_gate_up.dtype}, {w_down.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise MoEError(f"top-k ids {list(topk_ids.shape)} for {hidden.shape[0]} tokens")
    if topk_weights.shape != topk_ids.shape:
        raise MoEError(f"top-k weights {list(topk_weights.shape)}, ids {list(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point:
        raise MoEError(f"top-k ids must be integers, got {topk_ids.dtype}")


def _routing(
    hidden, w_gate_up, w_down, router_logits, top_k, renormalize, ids, weights, router=None,
    block_m=None,
):  # fmt: skip
    """(ids, weights, aligned) from either the router's logits or the given top k; checks
    operands. Logits are routed by `router` where given (a `moe_route.moe_route`-like
    callable: routing and alignment into `block_m` rows), `aligned` its (sorted_ids,
    expert_ids); else by `route`, `aligned` None (`align` is left to the caller)."""
    if (router_logits is None) == (ids is None and weights is None):
        raise MoEError("give either router_logits (and top_k) or topk_ids and topk_weights")
    aligned = None
    if router_logits is not None:
        experts = w_gate_up.shape[0] if w_gate_up.dim() == 3 else -1
        if router_logits.shape != (hidden.shape[0], experts) or not top_k:
            raise MoEError(
                f"router logits {list(router_logits.shape)} and top_k {top_k} for"
                f" {hidden.shape[0]} tokens and {experts} experts"
            )
        if router is None:
            ids, weights = route(router_logits, top_k, renormalize)
        else:
            ids, weights, *aligned = router(router_logits, top_k, renormalize, block_m)
    if ids is None or weights is None:
        raise MoEError("topk_ids and topk_weights go together")
    _check(hidden, w_gate_up, w_down, ids, weights)
    return ids, weights, aligned


def _pow2_between(n: int, low: int, high: int) -> int:
    return max(low, min(high, triton.next_power_of_2(n)))


def tiles(entries: int, num_experts: int) -> dict:
    """`experts_triton`'s block sizes and depth for `entries` (token, expert) pairs."""
    if entries >= PREFILL_ROWS * num_experts:
        return dict(PREFILL_TILES)
    return {"block_m": block_m_for(entries, num_experts), **DECODE_TILES}


def experts_triton(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    aligned: tuple[torch.Tensor, torch.Tensor] | None = None,
    summed: bool = True,
    **tuning,
) -> torch.Tensor:
    """The routed experts' weighted sum `[T, H]` in hidden's dtype, with the kernels (see the
    module docstring); `summed=False`: the k weighted outputs unsummed, `[top_k, T, H]`.
    `tuning`: the kernels' block sizes and depth (`tiles`' keys), `tiles`' choice for these
    entries where not given. `aligned`: the entries' (sorted_ids, expert_ids) for its
    `block_m` where the caller has them (`moe_route`'s), else `align` computes them."""
    _check(hidden, w_gate_up, w_down, topk_ids, topk_weights)
    if hidden.stride(1) != 1 or w_gate_up.stride(2) != 1 or w_down.stride(2) != 1:
        raise MoEError("hidden's and the weights' rows must be contiguous")
    tokens, width = hidden.shape
    num_experts, inner = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    top_k = topk_ids.shape[1]
    entries = tokens * top_k
    partial = torch.empty(tokens, top_k, width, dtype=hidden.dtype, device=hidden.device)
    if not entries:
        return _total(partial, summed)
    tuning = tiles(entries, num_experts) | tuning
    block_m, block_n, block_k = tuning.pop("block_m"), tuning.pop("block_n"), tuning.pop("block_k")
    if aligned is None:
        aligned = align(topk_ids, num_experts, block_m)
    sorted_ids, expert_ids = aligned
    act = torch.empty(entries, inner, dtype=hidden.dtype, device=hidden.device)
    scale = topk_weights.reshape(-1)
    in_float32 = hidden.dtype == torch.float32 or not hidden.is_cuda
    for gated, x, w, out, n, k, rows_a_token in (
        (True, hidden, w_gate_up, act, inner, width, top_k),
        (False, act, w_down, partial.view(entries, width), width, inner, 1),
    ):
        bn, bk = _pow2_between(n, 16, block_n), _pow2_between(k, 16, block_k)
        grid = (expert_ids.numel(), triton.cdiv(n, bn))
        _moe_matmul_kernel[grid](
            x, w, out, scale, sorted_ids, expert_ids, entries, n, k, rows_a_token,
            x.stride(0), w.stride(0), w.stride(1), out.stride(0),
            GATED=gated, IN_FLOAT32=in_float32, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
            **tuning,
            **dependent_launch(x),
        )  # fmt: skip
    return _total(partial, summed)


def _total(partial: torch.Tensor, summed: bool) -> torch.Tensor:
    """Each token's k weighted outputs `[T, k, H]` added up, or as `[k, T, H]` partials."""
    return partial.sum(1) if summed else partial.transpose(0, 1)


def experts_reference(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """The routed experts as transformers' experts module computes them, one expert at a time
    (it reads the experts hit back to the host), the k weighted outputs summed in float32."""
    _check(hidden, w_gate_up, w_down, topk_ids, topk_weights)
    tokens, top_k = topk_ids.shape
    partial = hidden.new_zeros(tokens, top_k, hidden.shape[1])
    for expert in topk_ids.unique().tolist():
        token, slot = torch.where(topk_ids == expert)
        act = silu_mul.reference(F.linear(hidden[token], w_gate_up[expert]))
        out = F.linear(act, w_down[expert]) * topk_weights[token, slot, None]
        partial[token, slot] = out.to(hidden.dtype)
    return partial.sum(1)


def fused_moe_triton(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    router_logits: torch.Tensor | None = None,
    top_k: int | None = None,
    renormalize: bool = False,
    topk_ids: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    router=None,
    **tuning,
) -> torch.Tensor:
    """The MoE layer's routed output `[T, H]` with the kernels, routed by `router_logits`
    `[T, E]` (with `top_k`, `renormalize`) or by the given `topk_ids` and `topk_weights`
    `[T, k]`. Logits are routed and aligned by `router`: `moe_route.moe_route` by default
    (one launch on CUDA where its sizes fit, `route`'s and `align`'s torch ops elsewhere);
    `moe_route.moe_route_triton`, the kernel wherever Triton runs (the tests run it under
    Triton's interpreter); `moe_route.reference`, the ops (the path before the kernel,
    which benchmarks/fused_moe.py times beside it). `tuning`: `experts_triton`'s block
    sizes and depth."""
    k = top_k or (topk_ids.shape[1] if topk_ids is not None else 0)
    tuning = tiles(hidden.shape[0] * k, w_gate_up.shape[0]) | tuning
    block_m = tuning["block_m"]
    ids, weights, aligned = _routing(
        hidden, w_gate_up, w_down, router_logits, top_k, renormalize, topk_ids, topk_weights,
        router or moe_route.moe_route, block_m,
    )  # fmt: skip
    return experts_triton(hidden, w_gate_up, w_down, ids, weights, aligned=aligned, **tuning)


def reference(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    router_logits: torch.Tensor | None = None,
    top_k: int | None = None,
    renormalize: bool = False,
    topk_ids: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    experts=None,
) -> torch.Tensor:
    """`fused_moe_triton`'s result as torch computes it (`route`, then `experts`:
    `experts_reference` by default)."""
    ids, weights, _ = _routing(
        hidden, w_gate_up, w_down, router_logits, top_k, renormalize, topk_ids, topk_weights
    )
    return (experts or experts_reference)(hidden, w_gate_up, w_down, ids, weights)


def fused_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    capturable: bool = False,
    **routing,
):
    """The kernels on CUDA, the reference elsewhere (`capturable`: its experts by
    `experts_gathered`, with no host readback, so that a captured step may run it)."""
    if hidden.is_cuda and triton is not None:
        return fused_moe_triton(hidden, w_gate_up, w_down, **routing)
    experts = experts_gathered if capturable else experts_reference
    return reference(hidden, w_gate_up, w_down, experts=experts, **routing)


def experts_gathered(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """The routed experts as `experts_reference` computes them, in torch ops whose count and
    shapes depend on the shapes only: each (token, expert) entry's matrices gathered and
    multiplied as a batch, so nothing is read back to the host and a step can be captured.
    It reads T k experts' weights a step (copies of them, where the kernels stream them
    once): the stand-in for the kernels where they cannot run, not a fast path."""
    _check(hidden, w_gate_up, w_down, topk_ids, topk_weights)
    tokens, top_k = topk_ids.shape
    experts = topk_ids.reshape(-1)
    x = hidden.repeat_interleave(top_k, dim=0)[:, :, None]  # [T k, H, 1]
    act = silu_mul.reference(torch.bmm(w_gate_up[experts], x)[..., 0])
    out = torch.bmm(w_down[experts], act[:, :, None])[..., 0] * topk_weights.reshape(-1, 1)
    return out.to(hidden.dtype).view(tokens, top_k, -1).sum(1)


def routed(block: torch.nn.Module) -> bool:
    """Whether `block` is a sparse MoE block `moe_forward` computes: a router `gate` (its
    `weight` `[E, H]`, `top_k`, `norm_topk_prob`) and `experts` in the layout the kernels
    take, and beside them nothing or a shared expert with its gate (`shared_expert`,
    `shared_expert_gate`, which `moe_forward` gates by a sigmoid). Asked of the structure,
    and of the router's own forward on a probe (it must pick and weigh as `route` does), so
    any model built of such blocks is, and one routing otherwise is not."""
    parts = {name for name, _ in block.named_children()}
    shared = {"shared_expert", "shared_expert_gate"}
    if parts not in ({"gate", "experts"}, {"gate", "experts"} | shared):
        return False
    gate = block.gate
    if not all(hasattr(gate, name) for name in ("weight", "top_k", "norm_topk_prob")):
        return False
    try:
        _experts_weights(block.experts)
    except MoEError:
        return False
    return _routes_as_route(gate)


def _routes_as_route(gate: torch.nn.Module) -> bool:
    """Whether the router's forward gives (logits, weights, ids) with the weights and ids
    `route` gives: its own forward on the CPU, with random float32 weights in place of its
    own (the rule is what is asked; its weights may be on the meta device), 4 tokens."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(tuple(gate.weight.shape), generator=generator)
    probe = torch.randn(4, weight.shape[1], generator=generator)
    with torch.no_grad():
        out = torch.func.functional_call(gate, {"weight": weight}, (probe,))
        ids, weights = route(F.linear(probe, weight), gate.top_k, gate.norm_topk_prob)
    if not isinstance(out, tuple) or len(out) != 3:
        return False
    return torch.equal(out[2], ids) and torch.equal(out[1], weights)


def _experts_weights(experts: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers experts module's (gate_up_proj, down_proj), refusing other layouts."""
    act = getattr(getattr(experts, "config", None), "hidden_act", "silu")
    layout = (
        getattr(experts, "is_transposed", False),
        getattr(experts, "has_bias", False),
        getattr(experts, "is_concatenated", True),
        getattr(experts, "has_gate", True),
    )
    if not hasattr(experts, "gate_up_proj") or act not in ("silu", "swish") or layout != (
        False, False, True, True
    ):  # fmt: skip
        raise MoEError(
            f"{type(experts).__name__}: the kernels take SiLU experts with gate_up_proj"
            " [E, 2 I, H] (gate rows first) and down_proj [E, H, I], no bias"
        )
    return experts.gate_up_proj, experts.down_proj


def moe_forward(
    block: torch.nn.Module, hidden: torch.Tensor, *, moe=None, summed: bool = True, shared=None
) -> torch.Tensor:
    """A transformers Qwen3-Omni sparse MoE block's forward
    (`Qwen3OmniMoeThinkerTextSparseMoeBlock`, `Qwen3OmniMoeTalkerTextSparseMoeBlock` and
    their like: a `gate` router and `experts`, and where it has one the talker's
    sigmoid-gated `shared_expert`) from the block's own parameters, hidden `[..., H]` to
    `[..., H]`. `moe` computes the routed experts:
    `fused_moe` by default (the kernels on CUDA, the reference elsewhere); tests pass
    `fused_moe_triton` to run the kernels in Triton's interpreter. `summed=False` (`moe`
    then `fused_moe_triton`, hidden `[T, H]`): a block without a shared expert gives its k
    weighted outputs unsummed, `[top_k, T, H]`, for `rms_norm` to add as its residual.
    `shared(x)`: the shared expert's output over rows `x` `[T, H]` (by default its module's;
    a decode step passes its own products), which the block weighs by its sigmoid gate."""
    moe = fused_moe if moe is None else moe
    gate = block.gate
    w_gate_up, w_down = _experts_weights(block.experts)
    x = hidden.reshape(-1, hidden.shape[-1])
    has_shared = hasattr(block, "shared_expert")
    unsummed = {} if summed or has_shared else {"summed": False}
    out = moe(
        x,
        w_gate_up,
        w_down,
        router_logits=F.linear(x, gate.weight),
        top_k=gate.top_k,
        renormalize=gate.norm_topk_prob,
        **unsummed,
    )
    if unsummed:
        return out
    if has_shared:
        # (as the block's own forward rounds: its product, then the sum)
        out = out + torch.sigmoid(block.shared_expert_gate(x)) * (shared or block.shared_expert)(x)
    return out.reshape(hidden.shape)


def experts_forward(
    experts: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """A transformers experts module's forward (the `ExpertsInterface` signature)."""
    w_gate_up, w_down = _experts_weights(experts)
    return fused_moe(
        hidden_states, w_gate_up, w_down, topk_ids=top_k_index, topk_weights=top_k_weights
    )


def register() -> str:
    """Adds `experts_forward` to transformers' experts implementations as IMPLEMENTATION, so a
    model loaded with `experts_implementation=IMPLEMENTATION` (or given it through
    `model.set_experts_implementation`) runs its MoE experts on the kernels. Returns the name."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, experts_forward)
    return IMPLEMENTATION
