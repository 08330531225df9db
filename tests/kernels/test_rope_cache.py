"""Rotary embedding fused with the static cache write, for decode rows (one a slot) and
prefill rows (a prompt's positions, many to a slot), with and without Qwen3's per-head q/k
RMSNorm before it: its reference is HF's `Qwen3RMSNorm`, `apply_rotary_pos_emb` and an
indexed copy, and its Triton kernel (interpreted on the CPU,
compiled on a GPU) agrees with the reference: to the bit on float32 in the interpreter,
within a step of bfloat16 on the GPU."""

import itertools

import pytest
import torch

from omniflow.kernels import rope_cache

# (rows, q heads, kv heads, head dim, slots, columns): GQA groups of 1, 2 and 7; head dims
# of 16 and 128; a head dim that is not a power of two; rows writing the last column.
SHAPES = [(1, 4, 4, 16, 2, 8), (3, 4, 2, 24, 4, 5), (2, 28, 4, 128, 3, 9)]


def cases() -> list[dict]:
    """Decode rows (row b writes slot b, some past the last column) and prefill rows (three
    times as many, each naming its slot, distinct columns of a slot)."""
    found = []
    g = torch.Generator().manual_seed(0)
    for (rows, q_heads, kv_heads, d, slots, columns), dtype, prefill, normed in itertools.product(
        SHAPES, (torch.float32, torch.bfloat16), (False, True), (False, True)
    ):
        n = 3 * rows if prefill else rows
        qkv = torch.randn(n, (q_heads + 2 * kv_heads) * d, generator=g).to(dtype)
        angle = torch.rand(n, d // 2, generator=g) * 50
        angle = torch.cat((angle, angle), dim=-1)
        cache = torch.randn(2, slots, kv_heads, columns, d, generator=g).to(dtype)
        slot, filled = None, torch.randint(0, columns + 2, (n,), generator=g)
        if prefill:
            slot = torch.randint(0, slots, (n,), generator=g)
            filled = torch.tensor([int((slot[:r] == slot[r]).sum()) for r in range(n)])
        norms = {}
        if normed:
            weights = (1 + 0.5 * torch.randn(2, d, generator=g)).to(dtype)
            norms = {"q_norm": weights[0], "k_norm": weights[1], "eps": 1e-6}
        found.append({
            "qkv": qkv, "cos": angle.cos().to(dtype), "sin": angle.sin().to(dtype),
            "filled": filled, "keys": cache[0], "values": cache[1],
            "q_heads": q_heads, "kv_heads": kv_heads, "slots": slot, **norms,
        })  # fmt: skip
    return found


def run_kernel(found: list[dict]) -> list[tuple]:
    """Runs under TRITON_INTERPRET=1: the rotated queries and the caches after the write."""
    return [(rope_cache.rope_cache_triton(**c), c["keys"], c["values"]) for c in found]


def test_the_reference_is_hf_rotary():
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    def hf_norm(weight: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
        norm = Qwen3RMSNorm(weight.shape[0], eps).to(weight.dtype)
        norm.weight.data.copy_(weight)
        return norm(x)

    for case in cases():
        rows, d = case["qkv"].shape[0], case["keys"].shape[-1]
        heads = case["qkv"].view(rows, -1, d)
        q = heads[:, : case["q_heads"], None]  # [B, Hq, 1, d] as HF's attention holds it
        k = heads[:, case["q_heads"] : case["q_heads"] + case["kv_heads"], None]
        if "q_norm" in case:  # Qwen3: each head normalized before the rotation
            q, k = hf_norm(case["q_norm"], q, case["eps"]), hf_norm(case["k_norm"], k, case["eps"])
        want_q, want_k = apply_rotary_pos_emb(q, k, case["cos"][:, None], case["sin"][:, None])
        keys = case["keys"].clone()
        got_q = rope_cache.reference(**{**case, "keys": keys, "values": case["values"].clone()})
        assert torch.equal(got_q, want_q[:, :, 0])
        column = case["filled"].clamp(max=keys.shape[2] - 1)
        slot = range(rows) if case["slots"] is None else case["slots"].tolist()
        for b in range(rows):
            assert torch.equal(keys[slot[b], :, column[b]], want_k[b, :, 0])


def assert_agree(got: torch.Tensor, want: torch.Tensor, steps: int) -> None:
    """Within `steps` steps of bfloat16; float32 to rounding."""
    tol = 1e-6 if got.dtype == torch.float32 else steps * 2**-7
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_kernel_agrees_with_the_reference(interpret):
    """Triton's interpreter rounds float32 to bfloat16 towards zero (the GPU rounds to
    nearest, as torch does): its bf16 results may sit a few steps off; float32 is exact
    (with q/k norms, to rounding: the kernel sums the mean square in another order)."""
    found = cases()
    for case, (q, keys, values) in zip(found, interpret(run_kernel, found), strict=True):
        mine = {**case, "keys": case["keys"].clone(), "values": case["values"].clone()}
        want = rope_cache.reference(**mine)
        assert torch.equal(values, mine["values"])  # copied, never rounded
        if q.dtype == torch.float32 and "q_norm" not in case:
            assert torch.equal(q, want) and torch.equal(keys, mine["keys"])
        assert_agree(q, want, steps=4)
        assert_agree(keys, mine["keys"], steps=4)


def test_shapes_are_checked():
    case = cases()[0]
    with pytest.raises(rope_cache.RopeError):
        rope_cache.rope_cache(**{**case, "q_heads": 3})
    with pytest.raises(rope_cache.RopeError, match="slots must be"):
        rope_cache.rope_cache(**{**case, "slots": torch.zeros(5, dtype=torch.int64)})
    with pytest.raises(rope_cache.RopeError, match="q_norm and k_norm"):
        rope_cache.rope_cache(**{**case, "q_norm": torch.ones(16)})


@pytest.mark.gpu
def test_kernel_agrees_with_the_reference_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for case in cases():
        on = {k: v.cuda() if torch.is_tensor(v) else v for k, v in case.items()}
        mine = {**on, "keys": on["keys"].clone(), "values": on["values"].clone()}
        assert_agree(rope_cache.rope_cache(**on), rope_cache.reference(**mine), steps=1)
        assert_agree(on["keys"], mine["keys"], steps=1)
        assert torch.equal(on["values"], mine["values"])
