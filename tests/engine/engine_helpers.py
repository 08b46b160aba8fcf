"""Helpers shared by the engine tests (a uniquely named module: several test folders have a
conftest.py, so `from conftest import ...` would pick up whichever was imported first)."""

import torch

from msaserve.engine.config import EngineConfig
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateOutput, GenerateRequest, SamplingParams
from msaserve.models.tokenizer import Tokenizer
from msaserve.models.transformer import MSATransformer


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
