"""Typed messages between the gateway and the model deployment (they cross a DeploymentHandle).

The gateway tokenizes (with the tokenizer the model deployment hands it in `ModelInfo`) and sends
an `msaserve.engine.types.GenerateRequest`; the model deployment streams the engine's
`GenerateOutput`s back, or a single `ModelError` when the engine refuses the request before
producing anything. Errors travel as values rather than exceptions so that their fields (param,
token counts, Retry-After) survive the trip intact.
"""

from dataclasses import dataclass
from typing import Any


@dataclass
class ModelError:
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None


@dataclass
class ModelInfo:
    """What the gateway needs from the model deployment: readiness, limits and the tokenizer."""

    name: str
    ready: bool
    max_model_len: int | None = None
    page_size: int | None = None
    tokenizer: Any = None
    """The engine's tokenizer (`encode`, `decode`, `apply_chat_template`, `eos_token_ids`)."""
    error: str | None = None
    """Set when loading failed; the gateway answers 503 with it."""
    image_token_id: int | None = None
    """The placeholder token of one image; None when the model has no vision tower."""
    video_token_id: int | None = None


@dataclass
class SessionInfo:
    """What the model replica that served a session knows about it (GET /v1/sessions/{id})."""

    session_id: str
    replica_id: str
    created_at: float
    last_used_at: float
    num_turns: int
    num_prompt_tokens: int
    """Prompt tokens of the latest turn."""
    num_cached_tokens: int
    """Of those, tokens whose pages came from the cache (earlier turns kept them)."""
    num_output_tokens: int
    """Output tokens over all turns."""
    active: bool
    """A request of this session is running now."""
