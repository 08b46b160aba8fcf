"""GET /metrics on the API port: the Prometheus text of this node's Ray metrics agent.

Ray exports every process's `ray.util.metrics` (msaserve's, Serve's, Ray's own) through the node's
metrics agent on its metrics-export port, which is random in a local start. The gateway fetches
that text from its own node's agent and returns it, so a scraper needs only the API port (behind
the API keys unless `http.metrics_open`). In a multi-node cluster this is the gateway node's view;
scrape each node's agent (KubeRay's PodMonitor) for the rest.
"""

import httpx
import ray

from msaserve.platform.errors import APIError

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _agent_url() -> str:
    """This node's metrics agent (`ray.nodes()`: NodeManagerAddress, MetricsExportPort)."""
    if not ray.is_initialized():
        raise APIError(503, "metrics are exported by Ray's metrics agent; this gateway runs outside Ray",
                       code="metrics_unavailable")
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id and node.get("MetricsExportPort"):
            return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    raise APIError(503, f"Ray lists no metrics export port for node {node_id}", code="metrics_unavailable")


class MetricsExport:
    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self._url: str | None = None

    async def text(self) -> str:
        self._url = self._url or _agent_url()
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                response = await client.get(self._url)
            response.raise_for_status()
        except httpx.HTTPError as e:
            self._url = None  # the agent may have restarted on another port
            raise APIError(503, f"Ray's metrics agent did not answer: {type(e).__name__}",
                           code="metrics_unavailable", retry_after_s=1.0) from None
        return response.text
