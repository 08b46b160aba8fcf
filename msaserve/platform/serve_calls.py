"""A model-deployment call of its own inside one HTTP request.

Ray Serve stamps every handle call a replica makes while serving an HTTP request with that
request's internal id (`RequestMetadata.internal_request_id`, from the request context), and its
request router indexes the calls waiting for a replica by that id: a second call of the same request
pending at the same time is not indexed ("retry path") and, since `MSARequestRouter` matches replicas
to calls by id only (no FIFO fallback, `router/serve_router.py`), is never assigned — it hangs. The
n choices of one request are such calls. `own_internal_id()` gives the calls made inside it a fresh
internal id, so concurrent calls of one request are routed independently.
"""

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from ray.serve import context as serve_context


@contextmanager
def own_internal_id() -> Iterator[str]:
    """Within the block, handle calls carry a new internal request id (yielded); the request's own
    context is restored after it (the context variable is reset, not overwritten)."""
    fresh = uuid.uuid4().hex
    current = serve_context._get_serve_request_context()
    token = serve_context._serve_request_context.set(replace(current, _internal_request_id=fresh))
    try:
        yield fresh
    finally:
        serve_context._serve_request_context.reset(token)
