"""The engine on a CUDA GPU with the Triton MSA ops: CUDA-graph decode gives the eager tokens,
preemption by swapping to pinned host memory resumes exactly, memory planning fills free HBM."""

from collections import Counter

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from msaserve.engine.config import EngineConfig
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateRequest, SamplingParams
from msaserve.models.presets import get_preset
from msaserve.models.transformer import MSATransformer, init_random_weights


@pytest.fixture(scope="module")
def model() -> MSATransformer:
    with torch.device("cuda"):
        built = MSATransformer(get_preset("tiny"), "msa").to(torch.bfloat16)
    return init_random_weights(built, seed=0).eval()


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (150, 71, 97, 20, 130)]


def run(model: MSATransformer, bursts: list[int] | None = None, **overrides
        ) -> tuple[LLMEngine, dict[str, list[int]]]:
    """bursts: gets, per engine step, the most tokens one request got in it."""
    settings = dict(model="tiny", device="cuda", dtype="bfloat16", num_pages=128, max_num_seqs=8,
                    max_num_batched_tokens=64, max_model_len=512)
    settings.update(overrides)
    engine = LLMEngine(EngineConfig(**settings), model=model)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts()):
        engine.add_request(GenerateRequest(f"r{i}", prompt, params))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        step = engine.step()  # one output per token: a burst is several outputs of one request
        if bursts is not None:
            bursts.append(max(Counter(output.request_id for output in step).values(), default=0))
        for output in step:
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
    return engine, tokens


def test_cuda_graph_decode_matches_eager(model):
    graphed, with_graphs = run(model, cuda_graphs=True)
    assert graphed.runner.graphs is not None, "decode graphs were not captured"
    _, eager = run(model, cuda_graphs=False)
    assert with_graphs == eager


def test_swap_preemption_resumes_exactly():
    # fp32: in bf16 a different batch composition (which preemption causes by design) changes
    # cuBLAS's rounding enough to flip near-tied greedy tokens of a random tiny model; the swap
    # itself must be exact, which fp32 makes visible.
    with torch.device("cuda"):
        fp32 = init_random_weights(MSATransformer(get_preset("tiny"), "msa"), seed=0).eval()
    _, roomy = run(fp32, cuda_graphs=False, dtype="float32")
    tight_engine, tight = run(fp32, cuda_graphs=False, num_pages=24, dtype="float32")
    assert tight_engine.scheduler.num_preemptions > 0
    assert tight == roomy
    assert tight_engine.block_manager.num_free_pages == 24


def test_memory_planning_uses_free_hbm(model):
    engine = LLMEngine(EngineConfig(model="tiny", device="cuda", dtype="bfloat16", max_num_seqs=4,
                                    max_model_len=512, gpu_memory_utilization=0.5), model=model)
    # The pool is capped at what 4 sequences of 512 tokens can use, plus the scratch page.
    assert engine.runner.num_pages == 4 * 512 // 16 + 1


def test_decode_rounds_with_cuda_graphs_match_single_steps():
    # fp32 for the reason given above: rounds change when requests join, hence batch composition.
    with torch.device("cuda"):
        fp32 = init_random_weights(MSATransformer(get_preset("tiny"), "msa"), seed=0).eval()
    single_bursts, round_bursts = [], []
    single_engine, single = run(fp32, single_bursts, dtype="float32")
    round_engine, rounds = run(fp32, round_bursts, dtype="float32", decode_steps=8)
    assert round_engine.runner.graphs is not None and single_engine.runner.graphs is not None
    assert rounds == single
    assert max(round_bursts) == 1  # each token handed out as its step ends
    assert max(single_bursts) == 1
    assert round_engine.block_manager.num_free_pages == 128


def test_a_round_on_cuda_hands_out_each_step_from_pinned_memory_behind_its_event():
    """`ModelRunner.queue_decode_round` on CUDA: the steps are queued at once, each step's tokens
    copied to pinned host memory behind an event; `step(i)` gives step i's, equal to the round's
    whole result."""
    from msaserve.engine.step_inputs import build_step_inputs

    with torch.device("cuda"):
        fp32 = init_random_weights(MSATransformer(get_preset("tiny"), "msa"), seed=0).eval()
    config = EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=64, max_num_seqs=2,
                          max_num_batched_tokens=256, max_model_len=512)
    engine = LLMEngine(config, model=fp32)
    for i, prompt in enumerate(prompts()[:2]):
        engine.add_request(GenerateRequest(f"r{i}", prompt, SamplingParams(max_tokens=40, temperature=0.0,
                                                                            ignore_eos=True)))
    while not engine.step():  # the prefill's step gives the first tokens
        pass
    batch = engine.scheduler.schedule()
    assert len(batch.seqs) == 2 and all(n == 1 for n in batch.num_new_tokens)
    for seq in batch.seqs:
        engine.block_manager.allocate_slots(seq, 6)
    inputs = build_step_inputs(batch, engine.page_size, engine.runner.device)
    round_ = engine.runner.queue_decode_round(inputs.input_ids, inputs.meta, 6)
    assert round_._host.is_pinned() and len(round_._events) == 6
    steps = [round_.step(i) for i in range(6)]
    assert steps == round_.all() and all(len(s) == 2 for s in steps)


@pytest.mark.parametrize("backend", ["msa", "dense"])
def test_m3_cuda_graph_decode_matches_eager(backend: str) -> None:
    """m3-mini at small widths (the M3 layer: fused projection, one head kernel per layer, fused
    residual norms, the one-launch SwiGLU), bf16, MSA and dense: graph-replayed decode gives the
    eager tokens. Two sequences, graphs of 1 and 2: no decode batch is padded, so both runs launch
    the same kernels with the same splits."""
    from msaserve.models.loader import load_model
    from msaserve.models.presets import M3_MINI_SMALL

    loaded = load_model("m3-mini", device="cuda", dtype=torch.bfloat16, attention_backend=backend,
                        progress=False, seed=0, **M3_MINI_SMALL, num_hidden_layers=2)
    results = []
    for graphs in (True, False):
        engine = LLMEngine(EngineConfig(model="m3-mini", model_overrides=M3_MINI_SMALL, device="cuda",
                                        dtype="bfloat16", attention_backend=backend, num_pages=160,
                                        max_num_seqs=2, max_num_batched_tokens=64, max_model_len=512,
                                        cuda_graphs=graphs), model=loaded.model, tokenizer=loaded.tokenizer)
        assert (engine.runner.graphs is not None) == graphs
        for i, prompt in enumerate(prompts()[:2]):
            engine.add_request(GenerateRequest(f"r{i}", prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                                                                ignore_eos=True)))
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for output in engine.step():
                tokens.setdefault(output.request_id, []).extend(output.token_ids)
        results.append(tokens)
    assert results[0] == results[1]
    assert all(len(t) == 12 for t in results[0].values())
