"""What every family's fused DiT blocks share (`omniflow.families.*.fused_blocks`): the stacked
q/k/v products, the MLP with its GELU in the first product's epilogue (`feed_forward`),
swapping a transformer's blocks' forward for a fused one and back, and the attention kernel
their attention runs on.

A family's fused block is a callable object that computes what its diffusers block's
`forward` computes; `fuse` sets it as each block's instance `forward` (the transformer's own
forward, which calls `block(...)`, then runs it), `modules_forward` takes it away for a
while (to measure or check the fused blocks against diffusers' own).

Attention (`Attention`): the fused blocks lay queries, keys and values out `[B, S, H, Dh]`
and call the stage's `attend`. Which kernel runs is the diffusion stage's `attention`
setting: `sdpa` (torch's `scaled_dot_product_attention`, whichever backend torch picks),
one SDPA backend forced (`flash`, `efficient`, `cudnn`, `math`), or `flash_attn` (the
flash-attn package's `flash_attn_func`, `[B, S, H, Dh]` without transposes; FlashAttention-3's
`flash_attn_interface` where that is what installs). `auto` (the default) times, on CUDA at
load, each kernel that runs at the transformer's heads and head dim over AUTO_TOKENS tokens
and keeps the fastest (a few tens of milliseconds); off CUDA it is `sdpa`. A masked call
(Qwen-Image's rows of different prompt lengths) runs `sdpa` whatever the choice: the
flash-attn functions take no mask. A forced SDPA backend, chosen or probed at other shapes,
that refuses a call's (a cross-attention's few text keys, say) leaves that call to torch's
own choice, said once a shape in the log: a request never fails on it.
benchmarks/attention.py measures the same kernels at the real models' shapes.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from diffusers.models.activations import GELU
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from omniflow.errors import OmniflowError
from omniflow.ir.kinds import DIT_ATTENTION
from omniflow.kernels.timing import cuda_median_ms

log = logging.getLogger(__name__)

# The tokens (of one row, two rows: a guided pair) `auto` times each kernel at.
AUTO_TOKENS = 4096
SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
# Packages whose `flash_attn_func(q, k, v)` takes `[B, S, H, Dh]`: FlashAttention-3 (Hopper)
# first, then FlashAttention-2.
FLASH_ATTN_MODULES = ("flash_attn_interface", "flash_attn")
CHOICES = DIT_ATTENTION  # "auto", then the kernels
KERNELS = CHOICES[1:]


class AttentionError(OmniflowError):
    """An attention kernel that does not run here was asked for."""


def stack_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor]:
    """One weight and bias for `linears`' outputs side by side; each module's own become
    views of them."""
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = torch.cat([m.bias.detach() for m in linears])
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data, m.bias.data = weight[start : start + rows], bias[start : start + rows]
        start += rows
    return weight, bias


def feed_forward(ff: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """diffusers' `FeedForward` `ff` on the rows `x` `[N, D]`. On CUDA a tanh-GELU MLP's first
    product adds its bias and applies the GELU in cuBLAS's epilogue (`_addmm_activation`,
    whose CUDA GELU is the tanh approximation; the CPU's is the exact one): no pass of its
    own over the `[N, inner]` hidden states, 3.7 % of Qwen-Image's 1024x1024 step on an
    H100 as a separate kernel."""
    act = ff.net[0]
    epilogue = isinstance(act, GELU) and act.approximate == "tanh" and act.proj.bias is not None
    if not (x.is_cuda and epilogue and x.dim() == 2):
        return ff(x)
    hidden = linear_gelu(act.proj, x)
    for layer in ff.net[1:]:  # dropout (none at inference) and the second product
        hidden = layer(hidden)
    return hidden


def linear_gelu(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """tanh-GELU(`linear`(`x`)) for CUDA rows `x` `[N, D]`, the bias and the GELU in the
    product's cuBLAS epilogue (whose CUDA GELU is the tanh approximation)."""
    return torch._addmm_activation(linear.bias, x, linear.weight.t(), use_gelu=True)


def fuse(blocks: nn.ModuleList, make: Callable[[nn.Module], Callable]) -> None:
    """Every block of `blocks` forwards on `make(block)` from now on."""
    for block in blocks:
        block.forward = make(block)


@contextlib.contextmanager
def modules_forward(blocks: nn.ModuleList) -> Iterator[None]:
    """Within: `blocks` run diffusers' forward (to measure or check the fused blocks against)."""
    fused = {block: block.__dict__.pop("forward", None) for block in blocks}
    try:
        yield
    finally:
        for block, forward in fused.items():
            if forward is not None:
                block.forward = forward


def _flash_attn_func() -> Callable | None:
    for name in FLASH_ATTN_MODULES:
        try:
            return importlib.import_module(name).flash_attn_func
        except ImportError:
            continue
    return None


class Attention:
    """`attend(q, k, v, mask)` on `[B, S, H, Dh]` queries, keys and values (mask: a boolean
    `[B, 1, 1, S_k]` or None) with one kernel of KERNELS; `[B, S, H, Dh]` out. A forced SDPA
    backend that refuses a call's shapes leaves them to torch's own choice (`fall_back`,
    said once a shape in the log), else raises."""

    def __init__(self, kernel: str = "sdpa", fall_back: bool = True):
        if kernel not in KERNELS:
            raise AttentionError(f"attention kernel {kernel!r}: one of {', '.join(CHOICES)}")
        self.kernel = kernel
        # Shapes (q's, k's) the forced SDPA backend refused: torch's own choice runs them.
        self.refused: set[tuple] = set()
        self.fall_back = fall_back
        self.flash_attn = _flash_attn_func() if kernel == "flash_attn" else None
        if kernel == "flash_attn" and self.flash_attn is None:
            raise AttentionError(
                "flash_attn is not installed (neither flash_attn_interface nor flash_attn imports)"
            )

    def __call__(self, q, k, v, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.flash_attn is not None and mask is None:
            out = self.flash_attn(q, k, v)
            return out[0] if isinstance(out, tuple) else out  # FA3 also returns the LSE
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        backend = SDPA_BACKENDS.get(self.kernel) if mask is None else None
        shapes = (tuple(q.shape), tuple(k.shape))
        if backend is not None and shapes not in self.refused:
            try:
                with warnings.catch_warnings():  # (SDPA warns why a forced backend cannot run)
                    warnings.simplefilter("ignore")
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
            except RuntimeError as err:
                if not self.fall_back:
                    raise
                # The kernel was chosen (or probed) at other shapes: one that refuses this
                # one (a cross-attention's few keys, say) leaves it to torch's own choice.
                self.refused.add(shapes)
                log.warning(
                    "attention %s refuses queries %s over keys %s (%s): torch's SDPA choice "
                    "runs them",
                    self.kernel,
                    list(q.shape),
                    list(k.shape),
                    str(err).splitlines()[0] if str(err) else type(err).__name__,
                )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2)


def refusal(kernel: str, q: torch.Tensor, k=None, v=None) -> str | None:
    """Why `kernel` does not run on `q`, `k`, `v` (`[B, S, H, Dh]`; k and v: q when not given),
    or None: it runs."""
    try:
        with warnings.catch_warnings():  # SDPA warns why a forced backend cannot run
            warnings.simplefilter("ignore")
            Attention(kernel, fall_back=False)(q, q if k is None else k, q if v is None else v)
    except Exception as err:  # a probe: any kernel's refusal means "not here"
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    return None


def fastest(heads: int, head_dim: int, dtype: torch.dtype, device) -> dict[str, float]:
    """{kernel: ms} on a CUDA device of each kernel that runs a guided pair's self-attention
    over AUTO_TOKENS tokens, fastest first."""
    q = torch.randn(2, AUTO_TOKENS, heads, head_dim, device=device, dtype=dtype)
    found = {}
    for kernel in KERNELS:
        if refusal(kernel, q) is None:
            attend = Attention(kernel)
            found[kernel] = cuda_median_ms(lambda attend=attend: attend(q, q, q), iters=3)
    return dict(sorted(found.items(), key=lambda item: item[1]))


def attention_for(setting: str, heads: int, head_dim: int, dtype: torch.dtype, device) -> Attention:
    """The stage's `attention` setting as an `Attention` (`auto`: see the module docstring)."""
    if setting not in CHOICES:
        raise AttentionError(f"attention {setting!r}: one of {', '.join(CHOICES)}")
    if setting != "auto":
        probe = torch.randn(2, 64, heads, head_dim, device=device, dtype=dtype)
        why = refusal(setting, probe)
        if why is not None:
            raise AttentionError(f"attention {setting!r} does not run here: {why}")
        return Attention(setting)
    if torch.device(device).type != "cuda":
        return Attention("sdpa")
    times = fastest(heads, head_dim, dtype, device)
    kernel = next(iter(times))
    log.info(
        "attention: %s (%s over %d tokens, %d heads of %d)",
        kernel,
        ", ".join(f"{k} {ms:.2f} ms" for k, ms in times.items()),
        AUTO_TOKENS,
        heads,
        head_dim,
    )
    return Attention(kernel)
