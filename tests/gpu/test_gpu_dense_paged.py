"""The compiled dense paged decode kernel on a CUDA GPU at real sizes (M3 shape: Hkv=4, G=16, D=128,
P=128) against the dense reference, its CUDA-graph capture, and the dense engine's graph decode."""

import itertools

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from kernel_inputs import PagedInputs, make_paged_inputs

from msaserve.engine.config import EngineConfig
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateRequest, SamplingParams
from msaserve.kernels.dense.gpu import dense_prefill
from msaserve.kernels.dense.naive import dense_decode as naive_dense_decode
from msaserve.kernels.dense.naive import dense_prefill as naive_dense_prefill
from msaserve.kernels.dense.paged_decode import dense_decode
from msaserve.models.presets import get_preset
from msaserve.models.transformer import MSATransformer, init_random_weights

BF16 = torch.bfloat16
# One token, one page short, exactly one page, a partial last page, and a 64K-token context.
LENS = (1, 127, 128, 4097, 65541)


def _m3_inputs(lens: tuple[int, ...], seed: int, dtype: torch.dtype = BF16) -> PagedInputs:
    gen = torch.Generator().manual_seed(seed)
    return make_paged_inputs(list(lens), 128, 4, 128, 1, 128, dtype, "cuda", generator=gen)


def _query(batch: int, num_q: int, seed: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, num_q, 64, 128, generator=gen).to("cuda", dtype)


def _reference(q: torch.Tensor, inputs: PagedInputs, tables: torch.Tensor | None = None) -> torch.Tensor:
    tables = inputs.block_tables if tables is None else tables
    return naive_dense_decode(q.float(), inputs.k_cache.float(), inputs.v_cache.float(), tables,
                              inputs.seq_lens)


@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("num_q", [1, 4])
def test_matches_reference_at_m3_shape(num_q: int, num_splits: int | None) -> None:
    inputs = _m3_inputs(tuple(max(n, num_q) for n in LENS), seed=num_q)
    q = _query(len(LENS), num_q, seed=num_q)
    got = dense_decode(q, inputs.k_cache, inputs.v_cache, inputs.block_tables, inputs.seq_lens,
                       num_splits=num_splits)
    torch.testing.assert_close(got.float(), _reference(q, inputs), atol=2e-2, rtol=2e-2)


def test_fp8_kv_cache() -> None:
    inputs = _m3_inputs((300, 5000), seed=4)
    inputs.k_cache = inputs.k_cache.to(torch.float8_e4m3fn)
    inputs.v_cache = inputs.v_cache.to(torch.float8_e4m3fn)
    q = _query(2, 1, seed=4)
    got = dense_decode(q, inputs.k_cache, inputs.v_cache, inputs.block_tables, inputs.seq_lens)
    torch.testing.assert_close(got.float(), _reference(q, inputs), atol=3e-2, rtol=3e-2)


def test_mixed_prefill_and_decode_step() -> None:
    """A step that prefills chunks while other sequences decode one token (continuous batching)."""
    q_lens = (1, 300, 1, 128, 1)
    inputs = _m3_inputs((4097, 2000, 65541, 128, 1), seed=6)
    q = torch.randn(sum(q_lens), 64, 128, generator=torch.Generator().manual_seed(6)).to("cuda", BF16)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda")
    args = (inputs.block_tables, inputs.seq_lens, cu)
    got = dense_prefill(q, inputs.k_cache, inputs.v_cache, *args)
    want = naive_dense_prefill(q.float(), inputs.k_cache.float(), inputs.v_cache.float(), *args)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_cuda_graph_replays_with_new_lengths_and_tables() -> None:
    """Captured once with a wide block table, replayed after the lengths and page tables changed
    in place: the graph holds no host-side copy of either."""
    lens_a, lens_b = (5, 3000, 129), (70000, 1, 8191)
    inputs_a, inputs_b = _m3_inputs(lens_a, seed=1), _m3_inputs(lens_b, seed=2)
    pool = max(inputs_a.k_cache.shape[0], inputs_b.k_cache.shape[0])
    k_cache = torch.zeros(pool, 128, 4, 128, dtype=BF16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    width = 600  # pages: as wide as max_model_len's table in the engine
    tables = torch.full((3, width), -1, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(3, dtype=torch.int32, device="cuda")
    q = torch.zeros(3, 1, 64, 128, dtype=BF16, device="cuda")

    def load(inputs: PagedInputs, seed: int) -> None:
        n = inputs.k_cache.shape[0]
        k_cache[:n], v_cache[:n] = inputs.k_cache, inputs.v_cache
        tables.fill_(-1)
        tables[:, : inputs.block_tables.shape[1]] = inputs.block_tables
        seq_lens.copy_(inputs.seq_lens)
        q.copy_(_query(3, 1, seed))

    load(inputs_a, 1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (autotune, compile) outside the graph
        dense_decode(q, k_cache, v_cache, tables, seq_lens)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dense_decode(q, k_cache, v_cache, tables, seq_lens)
    for inputs, seed in ((inputs_a, 1), (inputs_b, 2)):
        load(inputs, seed)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), _reference(q, inputs), atol=2e-2, rtol=2e-2)


def _engine_tokens(model: MSATransformer, cuda_graphs: bool) -> tuple[LLMEngine, dict[str, list[int]]]:
    engine = LLMEngine(EngineConfig(model="tiny", device="cuda", dtype="float32", attention_backend="dense",
                                    num_pages=128, max_num_seqs=8, max_num_batched_tokens=64,
                                    max_model_len=512, cuda_graphs=cuda_graphs), model=model)
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((150, 71, 97, 20, 130)):
        prompt = torch.randint(3, 512, (n,), generator=generator).tolist()
        engine.add_request(GenerateRequest(f"r{i}", prompt, params))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
    return engine, tokens


def test_dense_engine_decodes_in_cuda_graphs() -> None:
    # fp32: a graph pads the batch and its block tables to fixed sizes, so the kernel splits the
    # pages differently than eagerly (a different summation order); in bf16 that rounding can flip
    # near-tied greedy tokens of a random tiny model, in fp32 (IEEE dots) it does not.
    with torch.device("cuda"):
        model = init_random_weights(MSATransformer(get_preset("tiny"), "dense"), seed=0).eval()
    graphed, with_graphs = _engine_tokens(model, cuda_graphs=True)
    assert graphed.runner.graphs is not None, "the dense backend's decode graphs were not captured"
    _, eager = _engine_tokens(model, cuda_graphs=False)
    assert with_graphs == eager
