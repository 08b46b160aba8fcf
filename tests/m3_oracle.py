"""transformers' MiniMax-M3 processors as the test oracle.

They run on torchvision, which the dev dependencies cannot pin usefully: PyPI's torchvision wheels
are CUDA builds whose C++ ops do not load beside the CPU torch, and the wheel's import then fails
on registering fake kernels for `torchvision::nms` / `qnms`. `make setup` installs the wheel
(--no-deps) into `.oracle-site/` in the repository, outside the venv so that nothing else imports
it; here that directory goes on sys.path and the two op schemas are declared first (the ops are
never called: the processors use torchvision's pure-PyTorch transforms only). Tests skip when the
directory is absent. tests/conftest.py enables it before any test module imports transformers:
transformers' image modules check for torchvision once, on import.
"""

import sys
from pathlib import Path

import pytest
import torch

ORACLE_SITE = Path(__file__).resolve().parents[1] / ".oracle-site"
_DETECTION_OPS = ("nms", "qnms")


def enable_torchvision() -> bool:
    """Make the oracle's torchvision importable (tests/conftest.py calls this first thing, since
    transformers' image modules look for torchvision once, when imported). False if absent."""
    if "torchvision" in sys.modules:
        return True
    if not (ORACLE_SITE / "torchvision").is_dir():
        return False
    sys.path.insert(0, str(ORACLE_SITE))
    try:
        import torchvision
    except RuntimeError:  # "operator torchvision::nms does not exist": declare both, import again
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        for op in _DETECTION_OPS:
            torch.library.define(
                f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
            )
        import torchvision  # noqa: F401
    return True


def processors():
    """(image processor class, video processor class, processor class, video_utils module)."""
    if not enable_torchvision():
        pytest.skip(f"the torchvision oracle wheel is not installed in {ORACLE_SITE} (make setup)")
    from transformers import video_utils
    from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import MiniMaxM3VLImageProcessor
    from transformers.models.minimax_m3_vl.processing_minimax_m3_vl import MiniMaxM3VLProcessor
    from transformers.models.minimax_m3_vl.video_processing_minimax_m3_vl import MiniMaxM3VLVideoProcessor

    return MiniMaxM3VLImageProcessor, MiniMaxM3VLVideoProcessor, MiniMaxM3VLProcessor, video_utils


def m3_tokenizer():
    """msaserve's byte tokenizer plus M3's four vision markers as special tokens: (ours, HF fast)."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    from msaserve.models.tokenizer import Tokenizer
    from msaserve.preprocess.minimax_m3.text import (
        IMAGE_TOKEN,
        VIDEO_TOKEN,
        VISION_END_TOKEN,
        VISION_START_TOKEN,
    )

    ours = Tokenizer.byte_level(300)
    markers = [IMAGE_TOKEN, VIDEO_TOKEN, VISION_START_TOKEN, VISION_END_TOKEN]
    ours.backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in markers])
    return ours, PreTrainedTokenizerFast(tokenizer_object=ours.backend)
