"""MiniMax-M3 through msaserve's paged engine (LLMEngine: chunked prefill, batched decode, the
MSA ops) gives transformers' greedy tokens: 64 new tokens on prompts below and above top_k × block."""

import pytest
import torch
from m3_checkpoint import one_cpu_thread, write_m3_checkpoint

from msaserve.engine.config import EngineConfig
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateRequest, SamplingParams
from msaserve.models.loader import load_model

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures(one_cpu_thread.__name__)

NEW_TOKENS = 64
PROMPT_LENGTHS = (30, 100)  # the second is past top_k × block = 64 before decoding starts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_m3_checkpoint(tmp_path_factory.mktemp("m3") / "text", vl=False, seed=1)


def test_engine_greedy_tokens_match_transformers_generate(checkpoint) -> None:
    directory, oracle = checkpoint
    loaded = load_model(str(directory), attention_backend="msa", progress=False)
    config = EngineConfig(model=str(directory), num_pages=64, max_num_seqs=4, max_num_batched_tokens=24)
    engine = LLMEngine(config, model=loaded.model, tokenizer=loaded.tokenizer)
    engine.record_selections = True
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(f"r{i}", ids, params))
    tokens: dict[str, list[int]] = {}
    chunked = False
    while engine.has_unfinished():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
        chunked |= engine.runner.last_selections is not None and any(
            s.shape[0] not in (1, 2) for s in engine.runner.last_selections
        )
    assert chunked, "no prefill step ran the sparse layers"
    for i, ids in enumerate(prompts):
        with torch.inference_mode():
            # An explicit mask: generate() would otherwise mask prompt tokens equal to pad_token_id.
            expected = oracle.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                       max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert tokens[f"r{i}"] == expected[0, len(ids):].tolist(), f"prompt of {len(ids)} tokens"
