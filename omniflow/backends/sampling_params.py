"""A request's sampling parameters, checked the same way for every `ar` backend.

`Sampling.of(params, defaults, error)` takes what a request gives (temperature, top_p,
top_k, repetition_penalty, max_tokens, seed, stop), fills what it leaves out from the
stage's defaults and checks every value against the knobs' domains (`omniflow.sampling`,
the table admission checks requests against too), raising the backend's own error class
with all the problems at once. The transformers backend samples from the result itself;
the vLLM backend hands it to vLLM's `SamplingParams`.
"""

from __future__ import annotations

from dataclasses import dataclass

from omniflow import sampling
from omniflow.errors import OmniflowError

# The parameters with a default (the knob's neutral value, which a model's generation
# config may override); `seed` and `stop` have none.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens")
# Temperatures below this decode greedily, as vLLM's do: the logits divided by one overflow
# float32 (at 1e-45 to infinities whose softmax is NaN), and a draw at it is the argmax but
# for logits within ~1e-4 of the best.
GREEDY_BELOW = 1e-5


def neutral_defaults() -> dict:
    """Each of SAMPLING_KEYS at its knob's neutral value."""
    return {key: sampling.KNOBS[key].neutral for key in SAMPLING_KEYS}


@dataclass(frozen=True)
class Sampling:
    """One request's sampling parameters, checked."""

    temperature: float  # 0: greedy (also what a request's below GREEDY_BELOW becomes)
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
        problems = sampling.problems(value)
        seed = params.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            problems.append(f"seed {seed!r} (an integer)")
        if problems:
            raise error(f"bad sampling parameters: {'; '.join(problems)}")
        top_k = int(value["top_k"])
        temperature = float(value["temperature"])
        chosen = cls(
            0.0 if temperature < GREEDY_BELOW else temperature,
            float(value["top_p"]),
            -1 if top_k == 0 else top_k,  # 0 and -1 both mean no limit
            float(value["repetition_penalty"]),
            int(value["max_tokens"]),
            seed,
            frozenset(s for s in stop if isinstance(s, int)),
            tuple(s for s in stop if isinstance(s, str) and s),
        )
        return chosen
