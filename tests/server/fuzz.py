"""Schema fuzzing with schemathesis: requests generated from the server's own OpenAPI schema,
valid ones and broken ones, a bounded number per operation; none may get a 5xx."""

from __future__ import annotations

import contextlib

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable

MODES = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)


def fuzz(base: str, examples: int, headers: dict | None = None) -> dict[str, dict[int, int]]:
    """Status counts per operation; fails on the first 5xx with the request that caused it."""
    extra = {"headers": headers} if headers else {}
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json", **extra)
    counts: dict[str, dict[int, int]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in MODES:
            seen = counts.setdefault(f"{operation.label} {mode.value}", {})
            with contextlib.suppress(Unsatisfiable):  # no body: no broken variant
                _check(operation, mode, base, extra, examples, seen)
    return counts


def _check(operation, mode, base: str, extra: dict, examples: int, seen: dict) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,  # the same cases every run
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def check(case):
        reply = case.call(base_url=base, timeout=60, **extra)
        seen[reply.status_code] = seen.get(reply.status_code, 0) + 1
        assert reply.status_code < 500, (
            f"{operation.label}: {reply.status_code} {reply.text[:300]} for "
            f"{getattr(case, 'body', None)!r}"
        )

    check()
