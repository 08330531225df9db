"""A MoE layer's routing in one launch (`omniflow.kernels.moe_route`): the kernel, interpreted
on the CPU (compiled on a GPU, where `moe_route` dispatches to it), gives `route`'s ids and
weights (the weights within the rounding bound of its own float32 sums, ties to the lower
index) and `align`'s sorted entries and block experts on those ids, at a decode step's sizes
(1, 2, 7, 32 tokens; the thinker's 128 experts and 8 a token, the talker's 6), with random
logits, logits tied on a grid, tokens all picking the same experts, and the largest tile it
takes; past it the torch ops run. A whole fused MoE layer routed by the kernel equals the
layer routed by the ops."""

import functools

import numpy as np
import pytest
import torch

from omniflow.kernels import fused_moe, moe_route
from tests.kernels.test_fused_moe import block, real_block, tiny_config, weights

TOKENS = [1, 2, 7, 32]
ROUTERS = {"thinker": (128, 8), "talker": (128, 6)}  # experts, top k
KINDS = ["random", "tied", "same"]


def router_logits(g, kind: str, tokens: int, experts: int, dtype) -> torch.Tensor:
    """random: Gaussian (float32: distinct, far apart next to the rounding bound; bf16 ties
    some); tied: on a grid of eighths in [-2, 2) (32 values for 128 experts: every row ties,
    its distinct values e^(1/8) apart in probability);
    same: one tied row for every token (all pick the same experts, 2 blocks an expert at
    32 tokens)."""
    if kind == "random":
        return torch.randn(tokens, experts, generator=g).to(dtype)
    grid = torch.randint(-16, 16, (tokens if kind == "tied" else 1, experts), generator=g) / 8
    return grid.expand(tokens, experts).contiguous().to(dtype)


def cases() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    found = []
    for tokens in TOKENS:
        for experts, top_k in ROUTERS.values():
            for kind in KINDS:
                for dtype in (torch.float32, torch.bfloat16):
                    logits = router_logits(g, kind, tokens, experts, dtype)
                    found.append(
                        {
                            "router_logits": logits,
                            "top_k": top_k,
                            "renormalize": len(found) // 2 % 2 == 0,
                            "block_m": moe_route.block_m_for(tokens * top_k, experts),
                        }
                    )
    # The largest tile (64 x 128); a few experts, an expert over several blocks of 32 rows.
    found.append({**found[0], "router_logits": torch.randn(64, 128, generator=g)})
    few = torch.randn(37, 4, generator=g)
    found.append({**found[0], "router_logits": few, "top_k": 2, "block_m": 32})
    return found


def tied(logits: torch.Tensor, top_k: int) -> bool:
    """Whether some row's top k + 1 probabilities tie (so the tie rule decides its ids)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top = torch.sort(probs, dim=-1, descending=True).values[:, : top_k + 1]
    return bool((top.diff(dim=1) == 0).any())


def run_routes(found: list[dict]) -> list[tuple]:
    """Runs under TRITON_INTERPRET=1: the kernel on each case."""
    return [moe_route.moe_route_triton(**case) for case in found]


def lower_index_first(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The top k of torch's probabilities, ties to the lower index (a stable sort)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    return torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]


def assert_routes_as_torch(case: dict, got: tuple) -> None:
    """ids: the lower-index-first top k of torch's probabilities, and `route`'s (the same
    probabilities, its ids where nothing ties); weights `route`'s within the bound;
    sorted_ids and expert_ids `align`'s on the kernel's ids, the reference's without ties."""
    logits, top_k, block_m = case["router_logits"], case["top_k"], case["block_m"]
    ids, weights, sorted_ids, expert_ids = got
    want = moe_route.reference(**case)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    assert torch.equal(ids, lower_index_first(logits, top_k))
    assert torch.equal(probs.gather(1, ids), probs.gather(1, want[0]))
    tol = moe_route.weight_tolerance(logits.dtype, logits.shape[1], top_k)
    assert weights.dtype == logits.dtype and weights.shape == want[1].shape
    torch.testing.assert_close(weights.float(), want[1].float(), rtol=tol, atol=0)
    aligned = moe_route.align(ids, logits.shape[1], block_m)
    assert torch.equal(sorted_ids, aligned[0]) and torch.equal(expert_ids, aligned[1])
    if not tied(logits, top_k):
        assert torch.equal(ids, want[0])
        assert torch.equal(sorted_ids, want[2]) and torch.equal(expert_ids, want[3])


@pytest.fixture(scope="module", autouse=True)
def _jobs_ahead(interpret_ahead, request):
    """The file's three interpreted jobs, started together as it begins: they run side by
    side (kernels/conftest.py)."""
    interpret_ahead(
        request,
        {
            test_the_kernel_routes_and_aligns_as_torch: [(run_routes, cases())],
            test_the_kernels_sums_run_in_torchs_cuda_order: [(run_routes, cases())],
            test_a_layer_routed_by_the_kernel_equals_the_layer_routed_by_the_ops: [
                (run_layers, layer_cases())
            ],
            test_a_moe_block_routed_by_the_kernel_equals_the_block_routed_by_the_ops: [
                (run_blocks, stage_blocks())
            ],
        },
    )


@pytest.fixture(scope="module")
def routed(interpret) -> list[tuple[dict, tuple]]:
    """Each of `cases()` with the interpreted kernel's routing of it (one job for the two
    tests below: `run_routes` routes each case on its own)."""
    found = cases()
    return list(zip(found, interpret(run_routes, found), strict=True))


def test_the_kernel_routes_and_aligns_as_torch(routed):
    for case, got in routed:
        assert_routes_as_torch(case, got)


def cuda_order_weights(logits: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """The top-k weights [T, k] in float32 with torch's CUDA summation orders as the kernel
    docstring gives them (the warp softmax's lanes, ATen's sum of the k), each add and
    division IEEE float32 here, and numpy's `exp`, the interpreter's (on CUDA both sides
    call libdevice's `expf`)."""
    tokens, experts = logits.shape
    padded = 1 << (experts - 1).bit_length()
    x = torch.full((tokens, padded), float("-inf"))
    x[:, :experts] = logits.float()
    scores = torch.from_numpy(np.exp((x - x.max(dim=1, keepdim=True).values).numpy()))
    lanes_n = min(padded, 32)
    by_step = scores.view(tokens, padded // lanes_n, lanes_n)
    lanes = torch.zeros(tokens, lanes_n)
    for step in range(by_step.shape[1]):
        lanes = lanes + by_step[:, step]
    while lanes.shape[1] > 1:  # upper half onto lower
        lanes = lanes[:, : lanes.shape[1] // 2] + lanes[:, lanes.shape[1] // 2 :]
    probs = scores / lanes
    ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(1, ids)
    if not renormalize:
        return weights
    width = 1 << (top_k.bit_length() - 1)  # the largest power of two <= k
    lanes = weights[:, :width].clone()
    lanes[:, : top_k - width] += weights[:, width:]
    while lanes.shape[1] > 1:  # neighbours first
        lanes = lanes[:, 0::2] + lanes[:, 1::2]
    return weights / lanes


def test_the_kernels_sums_run_in_torchs_cuda_order(routed):
    """The float32 weights of the interpreted kernel, bit for bit, those of torch's CUDA
    summation orders (with the interpreter's `exp`): the orders the kernel reproduces (on
    CUDA torch keeps them up to 2 tokens: kernels/moe_route.py, "Numerics")."""
    found = [(case, got) for case, got in routed if case["router_logits"].dtype == torch.float32]
    assert found
    for case, got in found:
        want = cuda_order_weights(case["router_logits"], case["top_k"], case["renormalize"])
        assert torch.equal(got[1], want)


def test_ties_are_exercised():
    """Some cases tie inside a row's top k + 1, and `route`'s CPU topk breaks some of those
    ties another way than the lower index first (why the tests compare it by probability)."""
    found = [(case["router_logits"], case["top_k"]) for case in cases()]
    ties = [(logits, top_k) for logits, top_k in found if tied(logits, top_k)]
    assert len(ties) >= len(found) // 2
    assert any(
        not torch.equal(moe_route.route(logits, top_k, False)[0], lower_index_first(logits, top_k))
        for logits, top_k in ties
    )


def test_align_sorts_each_entry_into_its_experts_blocks():
    g = torch.Generator().manual_seed(3)
    # (tokens, experts, top k, block rows)
    for tokens, experts, top_k, block_m in [(1, 128, 8, 16), (37, 4, 2, 16), (300, 8, 3, 32)]:
        ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices
        sorted_ids, expert_ids = moe_route.align(ids, experts, block_m)
        entries, blocks = tokens * top_k, moe_route.most_blocks(tokens * top_k, experts, block_m)
        assert sorted_ids.shape == (blocks * block_m,) and expert_ids.shape == (blocks,)
        counts = torch.bincount(ids.flatten(), minlength=experts)
        used = int(((counts + block_m - 1) // block_m).sum())
        assert (expert_ids[:used] >= 0).all() and (expert_ids[used:] == -1).all()
        assert (expert_ids[:used].diff() >= 0).all()
        rows = sorted_ids.view(blocks, block_m)
        valid = rows < entries
        assert torch.equal(sorted_ids[sorted_ids < entries].sort().values, torch.arange(entries))
        assert (sorted_ids[~(sorted_ids < entries)] == entries).all()
        assert valid[:used, 0].all() and not valid[used:].any()  # no empty block is used
        for b in range(used):
            members = rows[b][valid[b]]
            assert (ids.flatten()[members] == expert_ids[b]).all()
            assert (members.diff() > 0).all()  # entry order within an expert
            assert torch.equal(valid[b], torch.arange(block_m) < len(members))  # padded at the end


def test_block_rows_follow_the_tokens_an_expert_gets():
    # A thinker decode step (128 experts, 8 a token) at 1, 32, 256 tokens, then prefill.
    assert [moe_route.block_m_for(t * 8, 128) for t in (1, 32, 256, 512, 1024, 4096)] == [
        16, 16, 16, 32, 64, 64,
    ]  # fmt: skip
    assert moe_route.most_blocks(8, 128, 16) == 8  # one block a chosen expert


def fallback_logits(device: str = "cpu") -> torch.Tensor:
    """65 tokens over 128 experts: one token past the kernel's tile."""
    return torch.randn(65, 128, generator=torch.Generator().manual_seed(4)).to(device)


def test_the_bound_and_the_fallback():
    """One program takes up to 64 tokens over 128 experts (a 64 x 128 tile), 8192 over 1;
    past it `moe_route` runs the torch ops (as it does off CUDA), and the kernel's launcher
    refuses, naming them."""
    assert moe_route.fits(64, 128, 16) and not moe_route.fits(65, 128, 16)
    assert moe_route.fits(1, 8192, 16) and not moe_route.fits(1, 8193, 16)
    assert not moe_route.fits(1, 128, 24)  # blocks of a power of two rows only
    for logits in (fallback_logits(), fallback_logits()[:32]):
        got = moe_route.moe_route(logits, 8, True, 16)
        for a, b in zip(got, moe_route.reference(logits, 8, True, 16), strict=True):
            assert torch.equal(a, b)
    with pytest.raises(moe_route.RouteError, match="route and align"):
        moe_route.moe_route_triton(fallback_logits(), 8, True, 16)


@pytest.mark.parametrize("top_k", [8, 6])
def test_the_kernel_compiles_for_an_h200(top_k):
    """Triton's interpreter takes code its compiler refuses: the kernel at a 32-token thinker
    and talker step (k = 6: the weights' sum pairs columns), as the launcher configures it,
    compiled here for sm_90 (Triton's own ptxas; no GPU needed) under a dependent launch
    (`triton_guard.dependent_launch`)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    meta, options = moe_route.launch_meta(32, 128, top_k, True, 16, on_cuda=True)
    meta["GDC"] = True
    pointers = {"logits_ptr": "*bf16", "ids_ptr": "*i64", "weights_ptr": "*bf16"}
    pointers |= {"sorted_ptr": "*i64", "expert_ids_ptr": "*i64"}
    sizes = dict.fromkeys(["tokens", "experts", "row_stride", "col_stride", "blocks"], "i32")
    signature = pointers | sizes | dict.fromkeys(meta, "constexpr")
    source = ASTSource(fn=moe_route._moe_route_kernel, signature=signature, constexprs=meta)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm["cubin"] and "div.rn.f32" in compiled.asm["ptx"]
    assert "griddepcontrol.wait" in compiled.asm["ptx"]


def test_operands_are_checked():
    for logits, top_k in [(torch.zeros(3), 2), (torch.zeros(3, 4), 5), (torch.zeros(3, 4), 0)]:
        with pytest.raises(moe_route.RouteError, match=r"\[T, E\] and top_k in 1..E"):
            moe_route.moe_route(logits, top_k, True, 16)


def layer_cases() -> list[dict]:
    """The thinker's and the talker's routers (128 experts, 8 and 6 a token) before narrow
    experts (H 32, I 16), float32, at 1 and 32 tokens of random logits, and 32 of tied ones."""
    g = torch.Generator().manual_seed(5)
    found = []
    for experts, top_k in ROUTERS.values():
        w_gate_up, w_down = weights(g, experts, 32, 16)
        for tokens, kind in ((1, "random"), (32, "random"), (32, "tied")):
            found.append(
                {
                    "hidden": torch.randn(tokens, 32, generator=g),
                    "w_gate_up": w_gate_up,
                    "w_down": w_down,
                    "router_logits": router_logits(g, kind, tokens, experts, torch.float32),
                    "top_k": top_k,
                    "renormalize": top_k == 8,
                }
            )
    return found


def stage_blocks() -> list[dict]:
    """transformers' thinker and talker MoE blocks (the talker's with its shared expert) at
    128 experts and narrow widths, a decode step of 32 tokens each."""
    g = torch.Generator().manual_seed(6)
    found = []
    for stage, (experts, top_k) in ROUTERS.items():
        config = tiny_config(stage, True, width=32, inner=16, experts=experts, top_k=top_k)
        module = block(stage, config, seed=len(found))
        x = torch.randn(32, 1, 32, generator=g)
        found.append({"stage": stage, "config": config, "state": module.state_dict(), "x": x})
    return found


def run_layers(found: list[dict]) -> list[torch.Tensor]:
    """Runs under TRITON_INTERPRET=1: each layer routed by the kernel, by the ops, and by the
    ops' alignment of the kernel's own ids and weights."""
    results = []
    for case in found:
        ids, scales, *_ = moe_route.moe_route_triton(
            case["router_logits"], case["top_k"], case["renormalize"], 16
        )
        given = {k: case[k] for k in ("hidden", "w_gate_up", "w_down")}
        results.append(fused_moe.fused_moe_triton(**case, router=moe_route.moe_route_triton))
        results.append(fused_moe.fused_moe_triton(**case, router=moe_route.reference))
        results.append(fused_moe.experts_triton(**given, topk_ids=ids, topk_weights=scales))
    return results


def run_blocks(blocks: list[dict]) -> list[torch.Tensor]:
    """Runs under TRITON_INTERPRET=1: each MoE block's forward routed by the kernel and by
    the ops."""
    results = []
    for case in blocks:
        module = block(case["stage"], case["config"], case["state"])
        with torch.no_grad():
            for router in (moe_route.moe_route_triton, moe_route.reference):
                moe = functools.partial(fused_moe.fused_moe_triton, router=router)
                results.append(fused_moe.moe_forward(module, case["x"], moe=moe))
    return results


def assert_within_weight_rounding(got: torch.Tensor, want: torch.Tensor, top_k: int) -> None:
    """A layer's output from weights within the bound of each other: each of the k terms
    within that share of itself."""
    tol = moe_route.weight_tolerance(torch.float32, 128, top_k)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * top_k * want.abs().max().item())


def test_a_layer_routed_by_the_kernel_equals_the_layer_routed_by_the_ops(interpret):
    """The same bits as the ops' alignment of the kernel's ids and weights (the experts'
    kernels then see the same operands); the ops' own routing's result within the weights'
    rounding where no logits tie (tied, the CPU topk may take another of the tied experts)."""
    found = layer_cases()
    results = interpret(run_layers, found)
    for i, case in enumerate(found):
        kernel, ops, ops_on_kernel_ids = results[3 * i : 3 * i + 3]
        assert torch.equal(kernel, ops_on_kernel_ids)
        if not tied(case["router_logits"], case["top_k"]):
            assert_within_weight_rounding(kernel, ops, case["top_k"])
    assert any(tied(case["router_logits"], case["top_k"]) for case in found)


def test_a_moe_block_routed_by_the_kernel_equals_the_block_routed_by_the_ops(interpret):
    """transformers' thinker and talker blocks through `moe_forward` (the talker's shared
    expert added after the routed experts), routed both ways."""
    blocks = stage_blocks()
    results = interpret(run_blocks, blocks)
    for j, case in enumerate(blocks):
        kernel, ops = results[2 * j : 2 * j + 2]
        assert_within_weight_rounding(kernel, ops, case["config"]["num_experts_per_tok"])


@pytest.mark.gpu
def test_the_compiled_kernel_routes_and_aligns_as_torch_on_gpu():
    """The interpreted test's cases on CUDA: the compiled kernel (libdevice's `expf`, as
    torch's softmax) against `route` and `align` there, in one launch."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from omniflow.kernels.timing import launches

    for case in cases():
        on = {k: v.cuda() if torch.is_tensor(v) else v for k, v in case.items()}
        got = moe_route.moe_route_triton(**on)
        assert_routes_as_torch(on, got)
    assert launches(lambda: moe_route.moe_route_triton(**on)) == 1
    # The dispatcher: the kernel up to the bound, the ops (route's and align's) past it.
    assert launches(lambda: moe_route.moe_route(**on)) == 1
    logits = fallback_logits("cuda")
    assert launches(lambda: moe_route.moe_route(logits, 8, True, 16)) > 1
    got = moe_route.moe_route(logits, 8, True, 16)
    for a, b in zip(got, moe_route.reference(logits, 8, True, 16), strict=True):
        assert torch.equal(a, b)


def real_routing(stage: str, tokens: int, device: str = "cuda") -> tuple:
    """Qwen3-Omni-30B-A3B's MoE block of `stage` at its published sizes in bf16 (random
    weights), a decode step of `tokens` tokens, and its router's logits as a routing case."""
    module = real_block(stage, device)
    width = module.gate.weight.shape[1]
    g = torch.Generator(device if device != "meta" else "cpu").manual_seed(7)
    x = torch.randn(tokens, width, generator=g, device=g.device).to(device, torch.bfloat16)
    gate = module.gate
    logits = torch.nn.functional.linear(x, gate.weight)
    case = {"router_logits": logits, "top_k": gate.top_k, "renormalize": gate.norm_topk_prob}
    case["block_m"] = moe_route.block_m_for(tokens * gate.top_k, logits.shape[1])
    return module, x, case


@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_the_real_routing_fits_one_program(stage):
    """The GPU test's set-up on the meta device: the published routers' logits [32, 128] fit
    the kernel, its blocks of 16 rows."""
    _, _, case = real_routing(stage, 32, "meta")
    assert case["router_logits"].shape == (32, 128) and case["block_m"] == 16
    assert moe_route.fits(32, 128, case["block_m"])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 32])
@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_real_blocks_routed_by_the_kernel_on_gpu(stage, tokens):
    """Qwen3-Omni-30B-A3B's MoE blocks at their published sizes in bf16: the router's own
    logits routed as torch routes them (bf16 logits may tie: compared as the interpreted
    test compares), and the layer routed by the kernel the same bits as the ops' alignment
    of the kernel's ids and weights, run after run."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    module, x, case = real_routing(stage, tokens)
    w_gate_up, w_down = module.experts.gate_up_proj, module.experts.down_proj
    with torch.no_grad():
        got = moe_route.moe_route_triton(**case)
        assert_routes_as_torch(case, got)
        layer = {k: case[k] for k in ("router_logits", "top_k", "renormalize")}
        out = fused_moe.fused_moe_triton(x, w_gate_up, w_down, **layer)
        assert torch.equal(out, fused_moe.experts_triton(x, w_gate_up, w_down, *got[:2]))
        assert torch.equal(fused_moe.fused_moe_triton(x, w_gate_up, w_down, **layer), out)
