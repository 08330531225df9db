"""A request's sampling parameters, checked the same way for every `ar` backend.

`Sampling.of(params, defaults, error)` takes what a request gives (temperature, top_p,
top_k, repetition_penalty, max_tokens, seed, stop), fills what it leaves out from the
stage's defaults and checks every value, raising the backend's own error class with all
the problems at once. The transformers backend samples from the result itself; the vLLM
backend hands it to vLLM's `SamplingParams`.
"""

from __future__ import annotations

from dataclasses import dataclass

from omniflow.errors import OmniflowError
from omniflow.ir.kinds import KINDS

# The parameters with a default (the `ar` kind's, which a model's generation config may
# override); `seed` and `stop` have none.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens")


def kind_defaults() -> dict:
    """The `ar` kind's default for each of SAMPLING_KEYS."""
    return {key: KINDS["ar"].params[key].default for key in SAMPLING_KEYS}


@dataclass(frozen=True)
class Sampling:
    """One request's sampling parameters, checked."""

    temperature: float  # 0: greedy
    top_p: float
    top_k: int  # -1: no limit
    repetition_penalty: float
    max_tokens: int
    seed: int | None
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...]

    @classmethod
    def of(cls, params: dict, defaults: dict, error: type[OmniflowError]) -> Sampling:
        """`params` checked, each of SAMPLING_KEYS it lacks (or gives as None) from
        `defaults`; raises `error` naming every bad value."""
        value = {k: defaults[k] if params.get(k) is None else params[k] for k in SAMPLING_KEYS}
        stop = params.get("stop") or []
        if not isinstance(stop, list) or not all(
            isinstance(s, (str, int)) and not isinstance(s, bool) for s in stop
        ):
            raise error(f"stop must be a list of strings and token ids, not {stop!r}")
        sampling = cls(
            float(value["temperature"]),
            float(value["top_p"]),
            int(value["top_k"]),
            float(value["repetition_penalty"]),
            int(value["max_tokens"]),
            params.get("seed"),
            frozenset(s for s in stop if isinstance(s, int)),
            tuple(s for s in stop if isinstance(s, str) and s),
        )
        problems = [
            f"{name} {got!r} ({rule})"
            for name, got, ok, rule in (
                ("temperature", sampling.temperature, sampling.temperature >= 0, ">= 0"),
                ("top_p", sampling.top_p, 0 < sampling.top_p <= 1, "in (0, 1]"),
                ("top_k", sampling.top_k, sampling.top_k == -1 or sampling.top_k > 0, "-1 or > 0"),
                (
                    "repetition_penalty",
                    sampling.repetition_penalty,
                    sampling.repetition_penalty > 0,
                    "> 0",
                ),
                ("max_tokens", sampling.max_tokens, sampling.max_tokens >= 1, ">= 1"),
            )
            if not ok
        ]
        seed = sampling.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            problems.append(f"seed {seed!r} (an integer)")
        if problems:
            raise error(f"bad sampling parameters: {'; '.join(problems)}")
        return sampling
