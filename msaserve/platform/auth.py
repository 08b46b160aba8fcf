"""API keys and per-key limits at the gateway.

Keys come from `auth.api_keys`, the variable named by `auth.api_keys_env` and the file
`auth.api_keys_file`; with none configured the API is open. Limits are per gateway replica: with N
gateway replicas a key may reach N × the configured rate.
"""

import hmac
import time
from collections import deque

from msaserve.platform.config import AuthConfig
from msaserve.platform.errors import APIError


class KeyLimits:
    """Sliding one-minute request window and an in-flight counter, per key."""

    def __init__(
        self, requests_per_minute: int | None, max_concurrent: int | None, clock=time.monotonic
    ) -> None:
        self.requests_per_minute = requests_per_minute
        self.max_concurrent = max_concurrent
        self._clock = clock
        self._recent: dict[str, deque[float]] = {}
        self._in_flight: dict[str, int] = {}

    def check_rate(self, key: str) -> None:
        if self.requests_per_minute is None:
            return
        now = self._clock()
        window = self._recent.setdefault(key, deque())
        while window and now - window[0] >= 60.0:
            window.popleft()
        if len(window) >= self.requests_per_minute:
            retry = 60.0 - (now - window[0])
            raise APIError(
                429,
                f"rate limit of {self.requests_per_minute} requests per minute reached for this API key",
                code="rate_limit_exceeded",
                retry_after_s=retry,
            )
        window.append(now)

    def acquire(self, key: str) -> None:
        """Count one more in-flight request for key; pair with `release` (a stream ends later)."""
        count = self._in_flight.get(key, 0)
        if self.max_concurrent is not None and count >= self.max_concurrent:
            raise APIError(
                429,
                f"{count} requests are in flight for this API key (limit {self.max_concurrent})",
                code="concurrency_limit_exceeded",
                retry_after_s=1.0,
            )
        self._in_flight[key] = count + 1

    def release(self, key: str) -> None:
        self._in_flight[key] = max(0, self._in_flight.get(key, 0) - 1)


class Authenticator:
    def __init__(self, config: AuthConfig) -> None:
        self.keys = [k.encode() for k in config.resolve_keys()]
        self.admin_keys = [k.encode() for k in config.admin_api_keys]
        self.limits = KeyLimits(config.requests_per_minute, config.max_concurrent_requests)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def is_admin(self, key: str) -> bool:
        """key: as `authenticate` returns it (a configured key)."""
        presented = key.encode("utf-8", "surrogatepass")
        return any([hmac.compare_digest(presented, admin) for admin in self.admin_keys])

    def authenticate(self, authorization: str | None) -> str:
        """The caller's key (or "anonymous" when auth is off); 401 when missing or wrong."""
        if not self.enabled:
            return "anonymous"
        if not authorization:
            raise APIError(
                401, "missing API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(
                401, "malformed Authorization header: expected 'Bearer <key>'", code="invalid_api_key"
            )
        # The header's own bytes (the ASGI server decodes header values as Latin-1, losslessly): a
        # key with non-ASCII characters is sent as UTF-8, as it is configured; re-encoding the
        # decoded text as UTF-8 turned each such byte into two, and that key never matched.
        presented = token.strip().encode("latin-1", "replace")
        # Compare against every key in constant time so timing reveals nothing about which matched.
        matches = [hmac.compare_digest(presented, key) for key in self.keys]
        if not any(matches):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")
        return self.keys[matches.index(True)].decode()  # as configured: the tenant is the key's
