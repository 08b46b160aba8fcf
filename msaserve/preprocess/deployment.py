"""The media pipeline as its own Ray Serve deployment: CPU replicas, scaled apart from the GPUs.

The platform composes it, passing replicas/autoscaling through `.options(...)`:

    PreprocessDeployment.options(autoscaling_config={...}, ray_actor_options={"num_cpus": 1})
        .bind(PreprocessConfig(...))

and calls `await handle.process.remote(content_parts)`. The result (numpy patches) travels through
the Ray object store. A bad medium raises `MediaError` in the caller (Ray re-raises it as an
instance of MediaError, status/code/message/param intact): the gateway maps it to a 4xx.
"""

import asyncio

from ray import serve

from msaserve.preprocess.config import PreprocessConfig
from msaserve.preprocess.pipeline import PreprocessResult
from msaserve.preprocess.select import preprocessor_for


@serve.deployment(
    name="preprocess",
    ray_actor_options={"num_cpus": 1},
    # Decoding is CPU-bound: a replica works on few requests at once and autoscaling sees the queue.
    max_ongoing_requests=4,
)
class PreprocessDeployment:
    def __init__(self, config: PreprocessConfig | dict | None = None, model_spec: str | None = None) -> None:
        if isinstance(config, dict):
            config = PreprocessConfig(**config)
        self.preprocessor = preprocessor_for(model_spec, config or PreprocessConfig())

    async def process(self, content_parts: list[dict]) -> PreprocessResult:
        """OpenAI content parts → PreprocessResult; raises MediaError (4xx) for bad media."""
        # A worker thread keeps the replica's event loop free for health checks while decoding.
        return await asyncio.to_thread(self.preprocessor.process, content_parts)

    def config(self) -> PreprocessConfig:
        return self.preprocessor.config
