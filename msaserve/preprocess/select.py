"""Which media processor a model gets: the checkpoint's own when msaserve implements it.

A checkpoint directory whose processor config names MiniMax-M3's image/video processor, or whose
config.json is model_type `minimax_m3_vl`, gets `M3Preprocessor` with the directory's settings;
everything else (presets, GGUF files, Qwen2-VL-style towers) gets the Qwen2-VL `Preprocessor`.
"""

import json
from pathlib import Path

from msaserve.preprocess.config import PreprocessConfig
from msaserve.preprocess.pipeline import Preprocessor

M3_MODEL_TYPES = ("minimax_m3_vl",)


def preprocessor_for(model_spec: str | None, config: PreprocessConfig) -> Preprocessor:
    directory = Path(model_spec) if model_spec else None
    if directory is None or not directory.is_dir():
        return Preprocessor(config)
    from msaserve.preprocess.minimax_m3.config import M3ProcessorConfig, is_m3_processor

    if is_m3_processor(directory) or _model_type(directory) in M3_MODEL_TYPES:
        from msaserve.preprocess.minimax_m3.processor import M3Preprocessor

        return M3Preprocessor(M3ProcessorConfig.from_directory(directory), config)
    return Preprocessor(config)


def _model_type(directory: Path) -> str | None:
    path = directory / "config.json"
    return json.loads(path.read_text()).get("model_type") if path.is_file() else None
