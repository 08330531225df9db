"""Schemathesis against the shared server's OpenAPI schema (every endpoint, every served
pipeline): a bounded number of generated requests, zero 5xx, and every engine still up."""

from tests.server.fuzz import fuzz


def test_fuzzed_requests_get_no_5xx_and_break_no_engine(served):
    counts = fuzz(served.base, examples=15)
    answered = sum(c.get(200, 0) for op, c in counts.items() if op.startswith("POST"))
    assert answered > 0  # some generated requests reached a pipeline and were answered
    with served.client() as http:
        state = http.get("/debug/inspect").json()
        assert all("error" not in engine for engine in state.values()), state
        assert all(engine["in_flight"] == 0 for engine in state.values())
        assert http.get("/health").status_code == 200
