"""Stored Responses API responses (`store: true`), kept on the model replica that served their
conversation, beside its session table (`session_table.py`).

A conversation (a response and those continuing it through `previous_response_id`) is one session:
its turns carry the session id `responses-<conversation>` scoped to the tenant, so the request
router's session affinity sends every turn — and the GET / DELETE of its responses — to the replica
that holds its pages and these records. Keys are tenant-scoped response ids: another API key's
response is not found. The least recently used records go first beyond `max_responses`.
"""

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StoredResponse:
    response: dict[str, Any]
    """The Response body as returned (JSON-ready)."""
    messages: list[dict[str, Any]]
    """The conversation through this response's output, as chat messages (`ChatMessage` dicts);
    instructions are not part of it (they apply to one response only)."""
    session_id: str
    """The conversation's scoped session id."""
    input_items: list[dict[str, Any]] = field(default_factory=list)
    """This response's own input, as items with ids (`GET /v1/responses/{id}/input_items`)."""


class ResponseStore:
    def __init__(self, max_responses: int = 10_000) -> None:
        self.max_responses = max_responses
        self._records: dict[str, StoredResponse] = {}

    def put(self, key: str, record: StoredResponse) -> None:
        self._records.pop(key, None)
        self._records[key] = record
        while len(self._records) > self.max_responses:
            del self._records[next(iter(self._records))]

    def get(self, key: str) -> StoredResponse | None:
        record = self._records.pop(key, None)
        if record is not None:
            self._records[key] = record  # most recently used last
        return record

    def delete(self, key: str) -> bool:
        return self._records.pop(key, None) is not None

    def __len__(self) -> int:
        return len(self._records)
