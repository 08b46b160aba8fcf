"""The engine on the real SmolLM2-135M-Instruct (dense backend) gives transformers' greedy tokens,
with both prompts batched and prefilled in chunks."""

import pytest
import torch

from msaserve.engine.config import EngineConfig
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    loader = pytest.importorskip("msaserve.models.loader", reason="the models helper's loader is missing")
    try:
        loaded = loader.load_model("smollm2", attention_backend="dense", progress=False)
    except loader.ModelFileMissing as error:
        pytest.skip(str(error))
    config = EngineConfig(model="smollm2", attention_backend="dense", num_pages=64,
                          max_num_batched_tokens=24, max_num_seqs=4)
    return LLMEngine(config, model=loaded.model, tokenizer=loaded.tokenizer)


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    from msaserve.models.gguf_loader import smollm2_gguf_path

    path = smollm2_gguf_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def test_dense_engine_matches_transformers_greedy(engine, hf_model):
    tokenizer = engine.tokenizer
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]))
               for p in PROMPTS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(f"r{i}", ids, params))
    tokens: dict[str, list[int]] = {}
    text: dict[str, str] = {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
            text[output.request_id] = text.get(output.request_id, "") + output.text
    for i, ids in enumerate(prompts):
        with torch.inference_mode():
            expected = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        expected = expected[0, len(ids):].tolist()
        assert tokens[f"r{i}"] == expected, PROMPTS[i]
        assert text[f"r{i}"] == tokenizer.decode([t for t in expected if t not in tokenizer.eos_token_ids])
    assert "Paris" in text["r0"]
