"""The batched sampler: its torch reference filters exactly as the transformers backend does,
and its Triton kernel (interpreted on the CPU, compiled on a GPU) keeps the same tokens,
takes the argmax on greedy rows and draws deterministically per (seed, step)."""

import pytest
import torch

from omniflow.kernels import sampling
from omniflow.kernels.sampling import Params, SamplingError

# Per row: (temperature, top_k, top_p, repetition_penalty). Greedy, top-k, top-p, both,
# neither, and a top-k past the number of finite logits when V = 1000.
ROWS = [
    (0.0, -1, 1.0, 1.3),
    (0.7, 20, 1.0, 1.0),
    (1.0, -1, 0.8, 1.2),
    (0.8, 50, 0.9, 1.05),
    (1.3, 0, 1.0, 1.0),
    (1.0, 995, 0.95, 0.9),
]
SUPPRESSED = 7
# Sizes no block divides. The interpreter runs 512-wide blocks (the GPU 4096-wide), so
# searches run both over the whole row and over candidate lists.
SIZES = [(6, 1000), (3, 4099)]
FLAT = 32  # rows of the determinism cases: a flat distribution over 64 tokens


def inputs(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Logits, a seen mask and per-row parameter columns for the first `rows` of ROWS."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 2
    logits[:, :SUPPRESSED] = -float("inf")  # as the backend masks suppressed ids
    seen = torch.rand(rows, vocab, generator=g) < 0.05
    temperature, top_k, top_p, penalty = (torch.tensor(c) for c in zip(*ROWS[:rows], strict=True))
    columns = {
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p.double(),
        "repetition_penalty": penalty,
        "seed": torch.randint(1 << 40, (rows,), generator=g),
        "step": torch.arange(rows) * 3,
    }
    return logits, seen, columns


def params(logits: torch.Tensor, columns: dict) -> Params:
    return Params(logits.shape[0], logits.device, **columns)


def flat(seed, step) -> tuple[torch.Tensor, dict]:
    """Zero logits over 64 tokens, temperature 1, no filters: draws depend on the RNG alone."""
    seed, step = torch.as_tensor(seed), torch.as_tensor(step)
    rows = max(seed.numel(), step.numel())
    columns = {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "repetition_penalty": 1.0}
    return torch.zeros(rows, 64), {**columns, "seed": seed, "step": step}


def cases() -> list[dict]:
    seeds = torch.arange(FLAT) * 7919
    found = []
    for rows, vocab in SIZES:
        logits, seen, columns = inputs(rows, vocab, seed=vocab)
        found.append({"logits": logits, "seen": seen, "columns": columns, "block": 512})
    for seed, step in (
        (seeds, 5),
        (seeds.flip(0), 5),
        (seeds[3:4], 5),
        (seeds[3], torch.arange(FLAT)),
    ):
        logits, columns = flat(seed, step)
        found.append({"logits": logits, "seen": None, "columns": columns, "block": 32})
    return found


def run_kernel(found: list[dict]) -> list[tuple]:
    """Runs under TRITON_INTERPRET=1: each case's ids and kept set from the kernel."""
    return [
        sampling.sample_triton(
            c["logits"],
            params(c["logits"], c["columns"]),
            c["seen"],
            with_mask=True,
            block=c["block"],
        )
        for c in found
    ]


@pytest.fixture(scope="module")
def kernel(interpret):
    """Each case with the kernel's ids and kept set."""
    found = cases()
    return [(c, *out) for c, out in zip(found, interpret(run_kernel, found), strict=True)]


def test_reference_filter_is_the_backends_warp():
    from omniflow.backends.transformers_ar import Sampling, _warp

    logits, seen, columns = inputs(6, 1000, seed=1)
    penalized, scores, kept = sampling.reference_filter(logits, params(logits, columns), seen)
    for i, (temperature, top_k, top_p, penalty) in enumerate(ROWS):
        row = logits[i]
        row = torch.where(seen[i], torch.where(row < 0, row * penalty, row / penalty), row)
        assert torch.equal(penalized[i], row)
        if temperature == 0:
            assert kept[i].nonzero().flatten().tolist() == [row.argmax().item()]
            continue
        warped = _warp(row, Sampling(temperature, top_p, top_k, penalty, 1, 0, frozenset(), ()))
        assert torch.equal(scores[i], warped)
        assert torch.equal(kept[i], warped > -float("inf"))


@pytest.mark.parametrize("case", range(len(SIZES)), ids=[f"B{b}-V{v}" for b, v in SIZES])
def test_kernel_keeps_what_the_reference_keeps(kernel, case):
    c, ids, mask = kernel[case]
    logits, seen, p = c["logits"], c["seen"], params(c["logits"], c["columns"])
    penalized, _, kept = sampling.reference_filter(logits, p, seen)
    greedy = p.temperature == 0
    assert torch.equal(ids[greedy], penalized[greedy].argmax(-1))
    assert torch.equal(mask, kept)
    assert mask.gather(1, ids[:, None]).all()
    # Same uniforms, same cumulative weights: the same tokens.
    assert torch.equal(ids, sampling.reference(logits, p, seen))


def test_draws_depend_on_seed_and_step_only(kernel):
    (_, batch, _), (_, flipped, _), (_, alone, _), (c, steps, _) = kernel[len(SIZES) :]
    assert len(set(batch.tolist())) > FLAT // 2
    assert torch.equal(flipped, batch.flip(0))  # a row's draw does not depend on its position
    assert alone.tolist() == batch[3:4].tolist()  # nor on the rest of the batch
    assert steps[5] == batch[3] and len(set(steps.tolist())) > FLAT // 2
    assert torch.equal(steps, sampling.reference(c["logits"], params(c["logits"], c["columns"])))


def test_uniform_is_uniform():
    u = sampling.uniform(torch.full((20000,), 12345), torch.arange(20000))
    assert torch.equal(u, sampling.uniform(torch.full((20000,), 12345), torch.arange(20000)))
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.std().item() - 12**-0.5) < 0.01
    other = sampling.uniform(torch.full((20000,), 12346), torch.arange(20000))
    assert (u != other).float().mean() > 0.99


# The GPU test's sizes: a codec's vocabularies (run at the small launch shape,
# `launch_shape`), past one 4096-wide block, and Qwen2.5's vocabulary.
GPU_SIZES = [(6, 2048), (6, 3072), (6, 4099), (6, 152064)]


@pytest.mark.parametrize(("rows", "vocab"), GPU_SIZES)
def test_sample_runs_the_reference_off_cuda(rows, vocab):
    """The GPU test's inputs sampled on the CPU: the reference's tokens, greedy rows the
    argmax of their penalized logits."""
    logits, seen, columns = inputs(rows, vocab, seed=vocab)
    p = params(logits, columns)
    got = sampling.sample(logits, seen=seen, **columns)
    assert got.dtype == torch.int64
    assert torch.equal(got, sampling.reference(logits, p, seen))
    penalized, _, _ = sampling.reference_filter(logits, p, seen)
    greedy = p.temperature == 0
    assert greedy.any() and torch.equal(got[greedy], penalized[greedy].argmax(-1))
    assert torch.equal(sampling.sample(logits, temperature=0), logits.argmax(-1))


def test_bad_inputs_are_refused():
    with pytest.raises(SamplingError, match=r"logits must be \[B, V\]"):
        sampling.sample(torch.zeros(10), temperature=1.0)
    with pytest.raises(SamplingError, match="seen must be a bool mask"):
        sampling.sample(torch.zeros(2, 10), temperature=1.0, seen=torch.zeros(2, 10))
    with pytest.raises(SamplingError, match=r"top_k has shape \[3\]"):
        sampling.sample(torch.zeros(2, 10), temperature=1.0, top_k=torch.tensor([1, 2, 3]))


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "vocab"), GPU_SIZES)
def test_kernel_matches_reference_on_gpu(rows, vocab):
    logits, seen, columns = inputs(rows, vocab, seed=vocab)
    logits, seen = logits.cuda(), seen.cuda()
    p = params(logits, columns)
    ids, mask = sampling.sample_triton(logits, p, seen, with_mask=True)
    penalized, _, kept = sampling.reference_filter(logits, p, seen)
    greedy = p.temperature == 0
    assert torch.equal(ids[greedy], penalized[greedy].argmax(-1))
    assert torch.equal(mask, kept)
    assert mask.gather(1, ids[:, None]).all()
    assert torch.equal(ids, sampling.reference(logits, p, seen))
    assert torch.equal(sampling.sample(logits, seen=seen, **columns), ids)
