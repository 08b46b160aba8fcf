"""CPU media pipeline: fetch, decode (Pillow, PyAV), sample, resize, patchify.

Public API: `Preprocessor(PreprocessConfig(...)).process(content_parts) -> PreprocessResult`
(one `MediaItem` per image/video), `MediaError` for every bad input (a 4xx), and the Ray Serve
deployment `msaserve.preprocess.deployment.PreprocessDeployment` (imported on its own: it loads Ray).
"""

from msaserve.preprocess.config import PreprocessConfig
from msaserve.preprocess.errors import MediaError
from msaserve.preprocess.pipeline import MediaItem, Preprocessor, PreprocessResult

__all__ = ["MediaError", "MediaItem", "PreprocessConfig", "PreprocessResult", "Preprocessor"]
