"""The optional API key, checked in constant time by both fronts (HTTP ``Authorization: Bearer``
header, gRPC ``authorization: Bearer`` metadata)."""

from __future__ import annotations

import hmac


class ApiKey:
    def __init__(self, key: str) -> None:
        self._key = key.encode()

    @property
    def required(self) -> bool:
        return bool(self._key)

    def allows(self, authorization: str | bytes | None) -> bool:
        """Whether an ``Authorization`` value (raw header bytes, or text) grants access; always
        true when no key is configured."""
        if not self._key:
            return True
        if isinstance(authorization, str):
            authorization = authorization.encode("utf-8", "surrogatepass")
        scheme, _, token = (authorization or b"").strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(token.strip(), self._key)
