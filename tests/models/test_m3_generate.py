"""MiniMax-M3 through msaserve's paged engine (LLMEngine: chunked prefill, batched decode, the
MSA ops) gives transformers' greedy tokens: 64 new tokens on prompts below and above top_k × block."""

import pytest
import torch
from m3_checkpoint import one_cpu_thread, write_m3_checkpoint

from msaserve.engine.config import EngineConfig
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateRequest, SamplingParams
from msaserve.models.loader import load_model
from msaserve.platform.cli import main

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures(one_cpu_thread.__name__)

NEW_TOKENS = 64
PROMPT_LENGTHS = (30, 100)  # the second is past top_k × block = 64 before decoding starts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_m3_checkpoint(tmp_path_factory.mktemp("m3") / "text", vl=False, seed=1)


@pytest.fixture(scope="module")
def checkpoint_local2(tmp_path_factory):
    """Two forced local blocks: the decode indexer's n_local path through the engine."""
    return write_m3_checkpoint(tmp_path_factory.mktemp("m3") / "local2", vl=False, seed=3,
                               text={"index_local_blocks": 2})


@pytest.mark.parametrize("which", ["checkpoint", "checkpoint_local2"])
def test_engine_greedy_tokens_match_transformers_generate(which, request) -> None:
    directory, oracle = request.getfixturevalue(which)
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
            # No end token (eos_token_id=[]): like ignore_eos, an end token is generated and decoding goes on
            # (min_new_tokens would instead forbid it and pick another token).
            expected = oracle.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                       max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
        assert tokens[f"r{i}"] == expected[0, len(ids):].tolist(), f"prompt of {len(ids)} tokens"


def test_generate_cli_prints_transformers_greedy_text(checkpoint, capsys) -> None:
    directory, oracle = checkpoint
    assert main(["generate", "--model", str(directory), "--prompt", "Hello", "--max-tokens", "12"]) == 0
    out, err = capsys.readouterr()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        expected = oracle.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                   do_sample=False)
    assert out == tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True) + "\n"
    assert out.strip() and "loading shards" in err  # some text; the progress bar


def test_generate_cli_names_an_unsupported_model_type(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "mixtral"}')
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert "model_type='mixtral' is not supported: allowed" in err and "minimax_m3_vl_text" in err
