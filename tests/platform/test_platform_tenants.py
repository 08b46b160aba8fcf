"""Issue 26, item 2: sessions, KV pages and prefix-cache hits belong to the API key's tenant. Another
key can neither read, delete nor time a hit on them; an admin key lists every tenant's sessions;
the operator may opt in to a shared prefix cache. In process (gateway app + a real tiny engine)."""

from collections.abc import Iterator

import pytest
from inprocess_app import TINY_CONFIG, InProcessGateway, inprocess_gateway

from msaserve.kvcache.page_hash import ROOT_HASH, page_hashes, tenant_root
from msaserve.platform.tenants import ANONYMOUS, make_tenant, split_scoped, tenant_id

MODEL = "msaserve/tiny"
KEY_A, KEY_B, ADMIN = "key-a-secret", "key-b-secret", "admin-secret"
AUTH = {"api_keys": [KEY_A, KEY_B], "admin_api_keys": [ADMIN]}
CONFIG = {**TINY_CONFIG, "auth": AUTH}
SHARED = {**TINY_CONFIG, "auth": {**AUTH, "share_prefix_cache": True}}
PROMPT = "the same long system prompt, word for word, for both tenants. " * 4  # several pages


@pytest.fixture(scope="module")
def gateway() -> Iterator[InProcessGateway]:
    with inprocess_gateway(CONFIG) as g:
        yield g


def headers(key: str, session: str | None = None) -> dict:
    h = {"Authorization": f"Bearer {key}"}
    return h | ({"X-Session-Id": session} if session else {})


def chat(gateway, key: str, session: str | None = None, content: str = "hello", data=None):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
    response = gateway.request("POST", "/v1/chat/completions", data, json=body, headers=headers(key, session))
    assert response.status_code == 200, response.text
    return response.json()


def test_tenant_ids_hide_the_key_and_salt_the_chain() -> None:
    a, b = make_tenant(KEY_A), make_tenant(KEY_B)
    assert KEY_A not in a.id and a.id == tenant_id(KEY_A) and a.id != b.id
    assert a.cache_salt == tenant_root(a.id) != b.cache_salt and a.cache_salt != ROOT_HASH
    assert make_tenant(KEY_A, share_prefix_cache=True).cache_salt == ROOT_HASH
    assert make_tenant(None).id == ANONYMOUS and make_tenant(None).cache_salt == ROOT_HASH
    ids = list(range(64))
    assert page_hashes(ids, 16, parent=a.cache_salt) != page_hashes(ids, 16, parent=b.cache_salt)
    assert split_scoped(a.scope("conv:1")) == (a.id, "conv:1")


def test_another_key_cannot_read_or_delete_a_session(gateway) -> None:
    chat(gateway, KEY_A, "conv-1")
    mine = gateway.request("GET", "/v1/sessions/conv-1", headers=headers(KEY_A))
    assert mine.status_code == 200 and mine.json()["session_id"] == "conv-1"
    assert mine.json()["num_turns"] == 1
    assert gateway.request("GET", "/v1/sessions/conv-1", headers=headers(KEY_B)).status_code == 404
    assert gateway.request("DELETE", "/v1/sessions/conv-1", headers=headers(KEY_B)).status_code == 404
    # B's own "conv-1" is another session; A's is untouched by B's turns.
    chat(gateway, KEY_B, "conv-1")
    chat(gateway, KEY_B, "conv-1")
    assert gateway.request("GET", "/v1/sessions/conv-1", headers=headers(KEY_A)).json()["num_turns"] == 1
    assert gateway.request("GET", "/v1/sessions/conv-1", headers=headers(KEY_B)).json()["num_turns"] == 2
    assert gateway.request("DELETE", "/v1/sessions/conv-1", headers=headers(KEY_A)).json()["deleted"]
    assert gateway.request("GET", "/v1/sessions/conv-1", headers=headers(KEY_B)).status_code == 200


def test_listing_is_per_tenant_and_all_for_an_admin(gateway) -> None:
    chat(gateway, KEY_A, "list-a")
    chat(gateway, KEY_B, "list-b")
    seen_by_a = gateway.request("GET", "/v1/sessions", headers=headers(KEY_A)).json()["data"]
    assert "list-a" in {s["id"] for s in seen_by_a} and "list-b" not in {s["id"] for s in seen_by_a}
    assert {s["tenant"] for s in seen_by_a} == {tenant_id(KEY_A)}
    seen_by_admin = gateway.request("GET", "/v1/sessions", headers=headers(ADMIN)).json()["data"]
    assert {("list-a", tenant_id(KEY_A)), ("list-b", tenant_id(KEY_B))} <= {
        (s["id"], s["tenant"]) for s in seen_by_admin
    }


def test_session_ids_are_checked(gateway) -> None:
    response = gateway.request("GET", "/v1/sessions/" + "x" * 300, headers=headers(KEY_A))
    assert response.status_code == 400 and response.json()["error"]["param"] == "session_id"


def cached_tokens(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_no_prefix_cache_hit_across_tenants(gateway) -> None:
    """The timing side channel: B's request with A's prompt must not be served from A's pages."""
    first = chat(gateway, KEY_A, content=PROMPT + "a")
    assert cached_tokens(first) == 0
    assert cached_tokens(chat(gateway, KEY_A, content=PROMPT + "b")) > 0  # A's own pages hit
    assert cached_tokens(chat(gateway, KEY_B, content=PROMPT + "c")) == 0  # B's chain never meets A's


def test_operator_may_share_the_prefix_cache(gateway) -> None:
    chat(gateway, KEY_A, content=PROMPT + "shared-a", data=SHARED)
    assert cached_tokens(chat(gateway, KEY_B, content=PROMPT + "shared-b", data=SHARED)) > 0


def test_the_router_hashes_a_request_from_its_tenant_root() -> None:
    """The replica registers a tenant's pages under its salted chain; the router's prefix match must
    use the same chain, or kv_aware routing would never see a hit once auth is on."""
    from msaserve.engine.types import GenerateRequest
    from msaserve.router.core import request_view

    ids = list(range(3, 67))
    salt = make_tenant(KEY_A).cache_salt
    view = request_view([GenerateRequest("r", ids, cache_salt=salt)], {}, 16, "r")
    assert list(view.page_hashes) == page_hashes(ids, 16, parent=salt)
    assert list(request_view([GenerateRequest("r", ids)], {}, 16, "r").page_hashes) == page_hashes(ids, 16)
