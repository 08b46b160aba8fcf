"""The engine's sparse-resident lane on CUDA (engine/kv/resident_lane.py): long requests move off the
pool, their steps replay as CUDA graphs (one per session), pinned host tiers through UVA views, and
the greedy tokens equal the pool's; with the tiny MiniMax-M3 (a full_attention layer), in bf16."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine.engine_helpers import greedy, random_prompt, run_to_completion
from parallel.m3_tiny import random_m3

from msaserve.engine.config import EngineConfig
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateRequest
from msaserve.models.presets import get_preset
from msaserve.models.transformer import MSATransformer, init_random_weights

LANE = dict(sparse_residency_sessions=2, sparse_residency_min_tokens=256, sparse_residency_budget=0.01)


M3_BF16 = pytest.param("m3", marks=pytest.mark.xfail(strict=False, reason=(
    "batch composition in bf16: the pool run decodes r0 beside the others' prefill chunks (mixed steps "
    "go through the prefill kernels) and batched, the lane alone through the decode kernels. With the "
    "GPU's kernels on the CPU the tiny M3 in bf16 first differs at r0's 20th token when the requests "
    "run together, and gives the pool's 40 tokens when they run one after the other "
    "(benchmarks/kvcache/lane_kernels_on_cpu.py --sequential); test_..._one_after_the_other checks that")))


@pytest.mark.parametrize("kind", ["msa", M3_BF16, "m3-fp32"])
def test_the_lane_on_cuda_gives_the_pools_greedy_tokens_and_replays_graphs(kind):
    """m3-fp32: the tiny M3 in fp32 (bf16 on the H200 and H100 gave other tokens from r0's 4th / a
    later token on, while the same kernels in fp32 under the Triton interpreter give the pool's)."""
    dtype = torch.float32 if kind.endswith("fp32") else torch.bfloat16
    if kind.startswith("m3"):
        model, vocab = random_m3(seed=0, backend="msa").to("cuda", dtype), 250
    else:
        model = init_random_weights(MSATransformer(get_preset("tiny"), "msa"), seed=0).eval()
        model, vocab = model.to("cuda", torch.bfloat16), 512
    prompts = [random_prompt(n, seed=40 + i, vocab=vocab) for i, n in enumerate((300, 420, 560))]

    def run(lane: bool) -> tuple[LLMEngine, dict]:
        config = EngineConfig(model="tiny", device="cuda", dtype=str(dtype).removeprefix("torch."),
                              attention_backend="msa",
                              num_pages=256, max_num_seqs=4, max_num_batched_tokens=128, max_model_len=640,
                              **(LANE if lane else {}))
        engine = LLMEngine(config, model=model)
        return engine, run_to_completion(
            engine, [GenerateRequest(f"r{i}", p, greedy(40)) for i, p in enumerate(prompts)])

    _, want = run(lane=False)
    engine, got = run(lane=True)
    first_differing = {r: next((i for i, (a, b) in enumerate(zip(got[r], want[r], strict=True)) if a != b),
                               None) for r in want}
    assert got == want, f"first differing token per request: {first_differing}"
    stats = engine.resident.stats
    # 3 × 40 tokens; the lane holds 2, so the third request decodes in the pool until one leaves
    # (85 lane steps on the CPU with these prompts)
    assert stats.moved_in == 3 and stats.graph_steps == stats.steps > 2 * 30
    assert stats.pages_fetched > 0 and stats.evictions > 0
    assert stats.replays >= stats.steps - 3 * 3  # each session: 2 eager warm-up steps, 1 captured


def test_a_session_of_the_lane_takes_over_an_ended_ones_graph_and_replays_from_its_first_step():
    """Two requests of one session size, one after the other, through a lane of one session: the
    second takes over the first one's session and CUDA graph (`ResidentSession.offload(into=)`), so
    every one of its steps is a replay; the tokens are the pool's."""
    from engine.engine_helpers import collect

    model = init_random_weights(MSATransformer(get_preset("tiny"), "msa"), seed=0).eval()
    model = model.to("cuda", torch.bfloat16)
    prompts = [random_prompt(n, seed=50 + i) for i, n in enumerate((300, 420))]  # 32-page sessions both
    requests = [GenerateRequest(f"r{i}", p, greedy(40)) for i, p in enumerate(prompts)]

    def engine(lane: bool) -> LLMEngine:
        config = EngineConfig(model="tiny", device="cuda", dtype="bfloat16", attention_backend="msa",
                              num_pages=256, max_num_seqs=4, max_num_batched_tokens=128, max_model_len=640,
                              **({**LANE, "sparse_residency_sessions": 1} if lane else {}))
        return LLMEngine(config, model=model)

    want = run_to_completion(engine(lane=False), requests)
    lane_engine, got = engine(lane=True), {}
    for request in requests:  # one after the other
        lane_engine.add_request(request)
        collect(lane_engine, got)
    assert got == want
    stats = lane_engine.resident.stats
    assert stats.moved_in == 2 and stats.sessions_reused == 1 and stats.host_tiers_allocated == 1
    assert stats.replays == stats.steps - 2  # only the first session's 2 warm-up steps run eagerly


def test_the_lane_on_cuda_gives_the_pools_bf16_tokens_for_requests_one_after_the_other():
    """The tiny M3 in bf16, the three requests one after the other in both engines: the pool never
    batches a request's decode tokens with another's, so the lane (each request alone through the
    decode kernels, its MSA layers from a per-head working set, its dense layer's K/V whole) must
    give the pool's tokens exactly. (Run together, bf16 rounding of mixed steps differs: the
    xfail case above.)"""
    from engine.engine_helpers import collect

    model = random_m3(seed=0, backend="msa").to("cuda", torch.bfloat16)
    prompts = [random_prompt(n, seed=40 + i, vocab=250) for i, n in enumerate((300, 420, 560))]

    def run(lane: bool) -> tuple[LLMEngine, dict]:
        config = EngineConfig(model="tiny", device="cuda", dtype="bfloat16", attention_backend="msa",
                              num_pages=256, max_num_seqs=4, max_num_batched_tokens=128, max_model_len=640,
                              **(LANE if lane else {}))
        engine, out = LLMEngine(config, model=model), {}
        for i, prompt in enumerate(prompts):
            engine.add_request(GenerateRequest(f"r{i}", prompt, greedy(40)))
            collect(engine, out)
        return engine, out

    _, want = run(lane=False)
    engine, got = run(lane=True)
    assert got == want
    assert engine.resident.stats.moved_in == 3 and engine.resident.stats.replays > 0
