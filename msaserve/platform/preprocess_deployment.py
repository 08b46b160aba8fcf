"""The Preprocess deployment: CPU replicas running `msaserve.preprocess.Preprocessor` (or the
served checkpoint's own processor, e.g. MiniMax-M3's).

Scaled apart from the model replicas so that GPUs never decode media; items travel to the model
deployment through the Ray object store inside the GenerateRequest.
"""

import asyncio
import time

from msaserve.platform.model_messages import ModelError
from msaserve.preprocess.limits import PreprocessLimits


class PreprocessDeployment:
    def __init__(self, limits: dict, model_spec: str | None = None) -> None:
        """model_spec: the served model (a checkpoint directory picks its own processor, see
        msaserve.preprocess.select)."""
        from msaserve.preprocess.config import PreprocessConfig
        from msaserve.preprocess.select import preprocessor_for

        config = PreprocessConfig(**PreprocessLimits(**limits).model_dump())
        self.preprocessor = preprocessor_for(model_spec, config)

    async def process(self, parts: list[dict]) -> tuple[list[object], float] | ModelError:
        """(media items, seconds spent) or a ModelError carrying the 4xx to return."""
        from msaserve.preprocess.errors import MediaError

        start = time.perf_counter()
        try:
            result = await asyncio.to_thread(self.preprocessor.process, parts)
        except MediaError as e:
            return ModelError(e.status, e.message, param=e.param, code=e.code)
        return list(result.media), time.perf_counter() - start
