"""Tenants: what a caller's API key may see of the state requests leave behind.

A tenant is the API key's id (a hash: the key itself is never stored or logged); with auth off
every caller is the one tenant `anonymous`. Sessions belong to their tenant: the gateway scopes
the client's `X-Session-Id` as `<tenant>:<id>` before anything (the request router's affinity, the
replica's session table, the KV cache service's record) sees it, so another key can neither read,
move nor delete it, and two tenants may use the same id without meeting. KV pages and prefix-cache
hits belong to it too: a request's page-hash chain starts at its tenant's root
(`kvcache.page_hash.tenant_root`), so identical prompts of two tenants share no page and a hit
cannot be timed across tenants, unless the operator opts in (`auth.share_prefix_cache`).
"""

import hashlib
from dataclasses import dataclass

from msaserve.kvcache.page_hash import ROOT_HASH, tenant_root

ANONYMOUS = "anonymous"
"""The tenant of every caller when no API key is configured."""
SEPARATOR = ":"


@dataclass(frozen=True)
class Tenant:
    id: str
    """`key-<16 hex>` (sha256 of the key) or `anonymous`."""
    is_admin: bool = False
    """Admin keys (`auth.admin_api_keys`) may list every tenant's sessions."""
    cache_salt: int = ROOT_HASH
    """The root of this tenant's page-hash chains (`GenerateRequest.cache_salt`)."""

    def scope(self, session_id: str) -> str:
        """The session id as the platform stores it."""
        return f"{self.id}{SEPARATOR}{session_id}"

    def owns(self, scoped_id: str) -> bool:
        return scoped_id.startswith(self.id + SEPARATOR)


def tenant_id(key: str | None) -> str:
    if not key or key == ANONYMOUS:
        return ANONYMOUS
    return "key-" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def make_tenant(key: str | None, is_admin: bool = False, share_prefix_cache: bool = False) -> Tenant:
    """The caller's tenant. With auth off (one tenant) or `share_prefix_cache`, chains start at
    ROOT_HASH and prefix-cache pages are shared by everyone, as before tenants existed."""
    tid = tenant_id(key)
    shared = share_prefix_cache or tid == ANONYMOUS
    return Tenant(tid, is_admin, ROOT_HASH if shared else tenant_root(tid))


def split_scoped(scoped_id: str) -> tuple[str, str]:
    """(tenant id, the client's session id) of a stored session id."""
    tenant, _, session_id = scoped_id.partition(SEPARATOR)
    return tenant, session_id
