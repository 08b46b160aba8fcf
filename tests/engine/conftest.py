"""Shared fixtures of the engine tests: the tiny preset with the MSA reference ops."""

import pytest
import torch

from msaserve.models.presets import get_preset
from msaserve.models.tokenizer import Tokenizer
from msaserve.models.transformer import MSATransformer, init_random_weights


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The tiny model's ops are far too small to gain from threads, and on a loaded 2-core machine
    OpenMP's spinning threads made them (and SmolLM2's) 20–30× slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model() -> MSATransformer:
    """tiny: P=16, K=4, so prompts over 64 tokens attend sparsely."""
    torch.manual_seed(0)
    return init_random_weights(MSATransformer(get_preset("tiny"), "naive"), seed=0).eval()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model: MSATransformer) -> Tokenizer:
    return Tokenizer.byte_level(tiny_model.config.vocab_size)
