"""The API key check every route and socket makes: `Authorization: Bearer KEY`, compared in
constant time."""

from __future__ import annotations

import hmac


def bearer_matches(authorization: str, key: str) -> bool:
    """Whether an `Authorization` header's value is `Bearer KEY` (the scheme in any case)."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and token_matches(token, key)


def token_matches(token: str, key: str) -> bool:
    return hmac.compare_digest(token.strip().encode(), key.encode())
