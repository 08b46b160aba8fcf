"""Shared fixtures of the engine tests: the tiny preset with the MSA reference ops."""

import pytest
import torch

from msaserve.engine.config import EngineConfig
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateOutput, GenerateRequest, SamplingParams
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


def make_engine(model: MSATransformer, tokenizer: Tokenizer | None = None, evicted_page_sink=None,
                **overrides) -> LLMEngine:
    settings = dict(model="tiny", num_pages=128, max_num_seqs=8, max_num_batched_tokens=64)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings), model=model, tokenizer=tokenizer,
                     evicted_page_sink=evicted_page_sink)


def random_prompt(length: int, seed: int, vocab: int = 512) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=generator).tolist()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_to_completion(engine: LLMEngine, requests: list[GenerateRequest]) -> dict[str, list[int]]:
    """Add all requests, step until done → output token ids per request id."""
    for request in requests:
        engine.add_request(request)
    return collect(engine)


def collect(engine: LLMEngine, outputs: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    outputs = {} if outputs is None else outputs
    finished: list[GenerateOutput] = []
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.token_ids)
            if output.finished:
                finished.append(output)
    return outputs
