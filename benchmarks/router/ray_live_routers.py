"""Ray's own request routers, set up to run live on the msaserve model deployment (live_compare.py).

- `ray_pow2`: Serve's default `PowerOfTwoChoicesRequestRouter`, i.e. `RequestRouterConfig()` with
  nothing set (what a user gets without a custom router).
- `ray_prefix_affinity`: Ray Serve LLM's `PrefixCacheAffinityRouter` (ray.llm, importable without
  vLLM), unchanged except for one adapter: it matches prompt *text* and reads it from a
  `.prompt` / `.messages` attribute of the call's argument, which msaserve's `GenerateRequest`
  does not have (the gateway tokenizes). `TokenPrefixCacheAffinityRouter` gives it the prompt
  token ids as text, one character per token id, so its prefix tree matches exactly the token
  prefixes the replicas cache. Its policy and defaults (imbalanced_threshold = inf,
  match_rate_threshold = 0.1) are Ray's.
"""

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest

TOKEN_CHAR_BASE = 0x100
"""Token id t becomes chr(TOKEN_CHAR_BASE + t) (the tiny preset's ids stay far below the surrogates)."""


def tokens_as_text(token_ids: list[int]) -> str:
    return "".join(chr(TOKEN_CHAR_BASE + int(t)) for t in token_ids)


class TokenPrefixCacheAffinityRouter(PrefixCacheAffinityRouter):
    """Ray's PrefixCacheAffinityRouter reading the prompt from `GenerateRequest.prompt_token_ids`."""

    def _extract_text_from_request(self, pending_request: PendingRequest) -> str:
        for arg in pending_request.args:
            token_ids = getattr(arg, "prompt_token_ids", None)
            if token_ids is not None:
                return tokens_as_text(token_ids)
        raise ValueError("the pending request has no argument with prompt_token_ids: allowed a "
                         "GenerateRequest")


def ray_router_config(name: str) -> RequestRouterConfig:
    """The model deployment's RequestRouterConfig for one of Ray's routers."""
    if name == "ray_pow2":
        return RequestRouterConfig()
    if name == "ray_prefix_affinity":
        return RequestRouterConfig(request_router_class=TokenPrefixCacheAffinityRouter)
    raise ValueError(f"router={name!r} is not one of Ray's: allowed ray_pow2, ray_prefix_affinity")
