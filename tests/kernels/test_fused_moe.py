"""The fused MoE experts: the router and the reference are transformers' Qwen3-Omni sparse
MoE block (thinker's and talker's, built tiny from their config classes with random
weights), and the Triton kernels (interpreted on the CPU in float32, compiled on a GPU;
routed by `moe_route`'s kernel, tests/kernels/test_moe_route.py) agree with the reference
and with the block."""

import pytest
import torch
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as qwen3_omni
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerTextConfig,
    Qwen3OmniMoeTextConfig,
)

from omniflow.catalog.components import builtin_files
from omniflow.kernels import fused_moe

# (tokens, hidden, expert width, experts, top k): sizes that divide no block; an expert
# given more entries than a block holds (37 x 2 over 4); every expert to every token (3 of
# 3); one token, most experts unused; no token; a prefill's many rows an expert (the
# prefill tiles).
SHAPES = [(3, 40, 24, 6, 2), (37, 24, 40, 4, 2), (5, 33, 17, 3, 3), (1, 40, 24, 6, 2)]
SHAPES += [(0, 40, 24, 6, 2), (200, 40, 24, 3, 2)]
BLOCKS = {
    "thinker": (Qwen3OmniMoeTextConfig, qwen3_omni.Qwen3OmniMoeThinkerTextSparseMoeBlock),
    "talker": (Qwen3OmniMoeTalkerTextConfig, qwen3_omni.Qwen3OmniMoeTalkerTextSparseMoeBlock),
}
REAL = "Qwen/Qwen3-Omni-30B-A3B-Instruct"


def weights(g, experts, width, inner, dtype=torch.float32, device="cpu"):
    """Gate/up [E, 2 I, H] and down [E, H, I], scaled so each product is of order one."""
    w_gate_up = torch.randn(experts, 2 * inner, width, generator=g, device=device) / width**0.5
    w_down = torch.randn(experts, width, inner, generator=g, device=device) / inner**0.5
    return w_gate_up.to(dtype), w_down.to(dtype)


def cases() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    found = []
    for tokens, width, inner, experts, top_k in SHAPES:
        hidden = torch.randn(tokens, width, generator=g)
        w_gate_up, w_down = weights(g, experts, width, inner)
        logits = torch.randn(tokens, experts, generator=g)
        for renormalize in (True, False):
            found.append(
                {
                    "hidden": hidden,
                    "w_gate_up": w_gate_up,
                    "w_down": w_down,
                    "router_logits": logits,
                    "top_k": top_k,
                    "renormalize": renormalize,
                }
            )
    ids, scales = fused_moe.route(found[2]["router_logits"], 2, False)
    given = {k: found[2][k] for k in ("hidden", "w_gate_up", "w_down")}
    found.append({**given, "topk_ids": ids, "topk_weights": scales})
    # Several K tiles with a remainder (40 = 16 + 16 + 8), narrower columns, taller blocks.
    found.append({**found[0], "block_n": 16, "block_k": 16})
    found.append({**found[2], "block_m": 32, "block_k": 16})
    return found


def tuning_free(case: dict) -> dict:
    return {k: v for k, v in case.items() if k not in ("block_m", "block_n", "block_k")}


def tiny_config(stage: str, renormalize: bool, width=40, inner=24, experts=6, top_k=2) -> dict:
    config = {
        "hidden_size": width,
        "moe_intermediate_size": inner,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "norm_topk_prob": renormalize,
    }
    if stage == "talker":
        config["shared_expert_intermediate_size"] = 20
    return config


def real_config(stage: str) -> dict:
    """The fields of Qwen3-Omni-30B-A3B's published config that its MoE block reads."""
    files = builtin_files(REAL)["config.json"]
    text = files["thinker_config"]["text_config"] if stage == "thinker" else files["talker_config"]
    text = text.get("text_config", text)
    keys = ["hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok"]
    keys += ["norm_topk_prob"] + (["shared_expert_intermediate_size"] if stage == "talker" else [])
    return {key: text[key] for key in keys}


def block(stage: str, config: dict, state: dict | None = None, seed: int = 0, **on):
    """transformers' sparse MoE block built from its config class; `state` or random weights
    (each matrix scaled by its fan-in, so outputs are of order one)."""
    config_class, block_class = BLOCKS[stage]
    settings = config_class(**config)
    settings._experts_implementation = "eager"
    with torch.device(on.get("device", "cpu")):
        module = block_class(settings).to(on.get("dtype", torch.float32))
    if state is not None:
        module.load_state_dict(state)
        return module
    if module.gate.weight.is_meta:  # shapes only: no weights to draw
        return module
    g = torch.Generator(on.get("device", "cpu")).manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            drawn = torch.randn(param.shape, generator=g, device=param.device)
            param.copy_(drawn / param.shape[-1] ** 0.5)
    return module


def block_cases() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    found = []
    for stage in BLOCKS:
        for renormalize in (True, False):
            config = tiny_config(stage, renormalize)
            module = block(stage, config, seed=len(found))
            hidden = torch.randn(2, 3, config["hidden_size"], generator=g)  # [batch, seq, H]
            found.append({"stage": stage, "config": config, "state": module.state_dict()})
            found[-1]["x"] = hidden
    config = tiny_config("thinker", True, width=24, inner=40, experts=3, top_k=3)
    module = block("thinker", config, seed=len(found))
    found.append({"stage": "thinker", "config": config, "state": module.state_dict()})
    found[-1]["x"] = torch.randn(1, 17, 24, generator=g)
    return found


def run_kernel(found: list[dict], blocks: list[dict]):
    """Runs under TRITON_INTERPRET=1: the kernels on each case, and each block's forward on
    them."""
    results = [fused_moe.fused_moe_triton(**case) for case in found]
    for case in blocks:
        module = block(case["stage"], case["config"], case["state"])
        with torch.no_grad():
            results.append(fused_moe.moe_forward(module, case["x"], moe=fused_moe.fused_moe_triton))
    return results


def assert_agree(got: torch.Tensor, want: torch.Tensor, steps: int = 1) -> None:
    """Within `steps` steps of bfloat16 relative to the largest value; float32 to rounding of
    sums in another order."""
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.abs().max().item() if want.numel() else 0.0
    tol = 1e-5 if want.dtype == torch.float32 else steps * 2**-7
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)


def test_a_prefill_takes_the_prefill_tiles():
    experts = 128
    decode = fused_moe.tiles(8 * 256, experts)  # a decode step of 256 tokens, top 8
    prefill = fused_moe.tiles(fused_moe.PREFILL_ROWS * experts, experts)
    assert decode == {"block_m": fused_moe.block_m_for(8 * 256, experts)} | fused_moe.DECODE_TILES
    assert prefill == fused_moe.PREFILL_TILES
    tokens, _, _, tiny_experts, top_k = SHAPES[-1]  # the kernels' tests run them there
    assert fused_moe.tiles(tokens * top_k, tiny_experts) == fused_moe.PREFILL_TILES


def test_the_router_is_transformers():
    g = torch.Generator().manual_seed(2)
    for stage in BLOCKS:
        for renormalize in (True, False):
            for dtype in (torch.float32, torch.bfloat16):
                module = block(stage, tiny_config(stage, renormalize), dtype=dtype)
                x = torch.randn(7, 40, generator=g).to(dtype)
                with torch.no_grad():
                    _, want_weights, want_ids = module.gate(x)
                    ids, scales = fused_moe.route(
                        torch.nn.functional.linear(x, module.gate.weight), 2, renormalize
                    )
                assert torch.equal(ids, want_ids) and torch.equal(scales, want_weights)
                assert scales.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reference_is_transformers_block(dtype):
    """Through `moe_forward` (the reference on the CPU), each block's forward: float32 to
    rounding; bf16 within two steps, transformers adding the k outputs in bf16 one expert
    at a time where the reference sums them in float32."""
    for case in block_cases():
        module = block(case["stage"], case["config"], case["state"]).to(dtype)
        x = case["x"].to(dtype)
        with torch.no_grad():
            assert_agree(fused_moe.moe_forward(module, x), module(x), steps=2)


def test_the_reference_is_transformers_experts_on_given_routing():
    for case in cases()[: 2 * len(SHAPES)]:
        (experts, inner2, width), top_k = case["w_gate_up"].shape, case["top_k"]
        config = tiny_config("thinker", case["renormalize"], width, inner2 // 2, experts, top_k)
        module = block("thinker", config)
        module.experts.gate_up_proj.data, module.experts.down_proj.data = (
            case["w_gate_up"],
            case["w_down"],
        )
        ids, scales = fused_moe.route(case["router_logits"], case["top_k"], case["renormalize"])
        with torch.no_grad():
            want = module.experts(case["hidden"], ids, scales)
        assert_agree(fused_moe.reference(**tuning_free(case)), want)


def test_kernel_agrees_with_the_reference_and_the_block(interpret):
    found, blocks = cases(), block_cases()
    results = interpret(run_kernel, found, blocks)
    for case, got in zip(found, results, strict=False):
        assert_agree(got, fused_moe.reference(**tuning_free(case)))
    for case, got in zip(blocks, results[len(found) :], strict=True):
        module = block(case["stage"], case["config"], case["state"])
        with torch.no_grad():
            assert_agree(got, module(case["x"]))


def run_unsummed(blocks: list[dict]):
    """Runs under TRITON_INTERPRET=1: each block's forward over its tokens `[T, H]`, with
    `summed=False`."""
    results = []
    for case in blocks:
        module = block(case["stage"], case["config"], case["state"])
        x = case["x"].reshape(-1, case["x"].shape[-1])
        with torch.no_grad():
            results.append(
                fused_moe.moe_forward(module, x, moe=fused_moe.fused_moe_triton, summed=False)
            )
    return results


def test_unsummed_a_blocks_k_outputs_add_up_to_its_forward(interpret):
    """Without a shared expert the block gives its k weighted outputs `[k, T, H]` (what the
    decode step's next norm adds up); the talker's, with one, its sum as before."""
    blocks = block_cases()
    for case, got in zip(blocks, interpret(run_unsummed, blocks), strict=True):
        module = block(case["stage"], case["config"], case["state"])
        with torch.no_grad():
            want = module(case["x"]).reshape(-1, case["x"].shape[-1])
        if case["stage"] == "talker":
            assert got.shape == want.shape
        else:
            assert got.shape == (case["config"]["num_experts_per_tok"], *want.shape)
            got = got.sum(0)
        assert_agree(got, want)


def test_registered_as_a_transformers_experts_implementation():
    name = fused_moe.register()
    for case in block_cases():
        module = block(case["stage"], case["config"], case["state"])
        with torch.no_grad():
            want = fused_moe.moe_forward(module, case["x"])
            module.experts.config._experts_implementation = name
            assert torch.equal(module(case["x"]), want)


def test_operands_are_checked():
    hidden, w_gate_up, w_down = torch.zeros(3, 8), torch.zeros(4, 10, 8), torch.zeros(4, 8, 5)
    logits, ids = torch.zeros(3, 4), torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(fused_moe.MoEError, match="either"):
        fused_moe.fused_moe(hidden, w_gate_up, w_down, top_k=2)
    with pytest.raises(fused_moe.MoEError, match="either"):
        fused_moe.fused_moe(hidden, w_gate_up, w_down, router_logits=logits, topk_ids=ids)
    with pytest.raises(fused_moe.MoEError, match="go together"):
        fused_moe.fused_moe(hidden, w_gate_up, w_down, topk_ids=ids)
    with pytest.raises(fused_moe.MoEError, match="router logits"):
        fused_moe.fused_moe(hidden, w_gate_up, w_down, router_logits=logits[:, :3], top_k=2)
    with pytest.raises(fused_moe.MoEError, match="do not chain"):
        fused_moe.fused_moe(hidden, w_gate_up, w_down[..., :4], router_logits=logits, top_k=2)
    with pytest.raises(fused_moe.MoEError, match="hidden is"):
        fused_moe.fused_moe(
            hidden.bfloat16(), w_gate_up, w_down, router_logits=logits.bfloat16(), top_k=2
        )
    with pytest.raises(fused_moe.MoEError, match="weights"):
        fused_moe.fused_moe(hidden, w_gate_up, w_down, topk_ids=ids, topk_weights=torch.zeros(3, 3))
    module = block("thinker", tiny_config("thinker", True))
    module.experts.has_bias = True
    with pytest.raises(fused_moe.MoEError, match="no bias"):
        fused_moe.moe_forward(module, torch.zeros(2, 40))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_agrees_with_the_reference_on_gpu(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for case in cases():
        on = {
            k: v.cuda().to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in case.items()
        }
        on = {k: v.cuda() if torch.is_tensor(v) else v for k, v in on.items()}
        got = fused_moe.fused_moe_triton(**on)
        assert_agree(got, fused_moe.reference(**tuning_free(on)), steps=4)


def real_block(stage: str, device: str = "cuda"):
    return block(stage, real_config(stage), seed=4, device=device, dtype=torch.bfloat16)


@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_the_real_blocks_build_from_the_published_config(stage):
    """The GPU tests' blocks at Qwen3-Omni-30B-A3B's sizes, on the meta device: the experts'
    matrices as the kernels take them, [E, 2 I, H] and [E, H, I]."""
    config = real_config(stage)
    module = real_block(stage, "meta")
    experts, width = config["num_experts"], config["hidden_size"]
    inner = config["moe_intermediate_size"]
    assert module.gate.weight.shape == (experts, width)
    assert module.experts.gate_up_proj.shape == (experts, 2 * inner, width)
    assert module.experts.down_proj.shape == (experts, width, inner)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 32, 256, 2048])
@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_real_shapes_agree_with_the_block_on_gpu(stage, tokens):
    """Qwen3-Omni-30B-A3B's MoE block at its published sizes in bf16: the kernels against
    the reference (the same roundings, sums in another order) and transformers' own forward
    (which also adds the k outputs in bf16); the same bits on a second run, and through
    transformers' experts interface."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    module = real_block(stage)
    g = torch.Generator("cuda").manual_seed(5)
    # [tokens, 1, H]: a decode step's batch, at 2,048 tokens as many rows as a prefill's.
    x = torch.randn(tokens, 1, module.gate.weight.shape[1], generator=g, device="cuda")
    x = x.to(torch.bfloat16)
    with torch.no_grad():
        got = fused_moe.moe_forward(module, x)
        assert_agree(got, fused_moe.moe_forward(module, x, moe=fused_moe.reference), steps=4)
        assert_agree(got, module(x), steps=6)
        assert torch.equal(fused_moe.moe_forward(module, x), got)
        module.experts.config._experts_implementation = fused_moe.register()
        assert torch.equal(module(x), got)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 32])
def test_a_decode_step_captures_in_a_cuda_graph(tokens):
    """No host sync on the way (a capture would fail on one): the router, the align step and
    the kernels replay on new hidden states as they run eagerly."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    module = real_block("thinker")
    g = torch.Generator("cuda").manual_seed(6)

    def draw() -> torch.Tensor:
        width = module.gate.weight.shape[1]
        return torch.randn(tokens, width, generator=g, device="cuda").to(torch.bfloat16)

    static = draw()
    with torch.no_grad():
        fused_moe.moe_forward(module, static)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_moe.moe_forward(module, static)
        for _ in range(2):
            static.copy_(draw())
            graph.replay()
            assert_agree(out, fused_moe.moe_forward(module, static))


def test_routed_blocks_are_known_by_their_shape_and_their_routers_rule():
    """`routed` (what lets the static decode step take a MoE layer) holds for both stages'
    blocks, at the published sizes on the meta device too (the router's rule is probed on
    the CPU with weights of its own); it fails for a router that picks by another rule, and
    for experts in another layout."""
    for stage in BLOCKS:
        assert fused_moe.routed(block(stage, tiny_config(stage, True)))
        assert fused_moe.routed(block(stage, real_config(stage), device="meta"))
    module = block("thinker", tiny_config("thinker", True))
    softmax_router = type(module.gate)

    class SigmoidRouter(softmax_router):  # DeepSeek-V3-like scores: sigmoid, not softmax
        def forward(self, hidden):
            logits = hidden @ self.weight.T
            weights, ids = torch.topk(torch.sigmoid(logits), self.top_k, dim=-1)
            return logits, weights.to(logits.dtype), ids

    module.gate.__class__ = SigmoidRouter
    assert not fused_moe.routed(module)
    module.gate.__class__ = softmax_router
    assert fused_moe.routed(module)
    module.experts.has_bias = True
    assert not fused_moe.routed(module)
