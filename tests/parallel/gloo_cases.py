"""What each spawned gloo rank runs for test_parallel_equivalence.py (a module, so that
torch.multiprocessing can import it in the children).

One spawn of 4 processes runs every layout: for each, the processes outside it only take part in
creating its groups. Each rank of a layout builds the same random tiny M3, keeps its shard, and
saves (a) the logits of every position of a 100-token prefill (past P·K = 64: sparse selection
bites) and (b) the greedy tokens of an LLMEngine run over 3 requests (prefill chunks + decode).
"""

import datetime
from pathlib import Path

import torch
import torch.distributed as dist
from m3_tiny import prompt, random_m3

from msaserve.engine.config import EngineConfig
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.parallel.comm import build_groups
from msaserve.engine.parallel.layout import ParallelLayout
from msaserve.engine.parallel.shard import shard_m3_model
from msaserve.engine.types import GenerateRequest, SamplingParams
from msaserve.models.metadata import AttentionMetadata

LAYOUTS = [(2, 1), (1, 2), (4, 1), (1, 4), (2, 2)]
"""(tensor_parallel_size, expert_parallel_size) of each case."""
PREFILL = 100


def engine_config() -> EngineConfig:
    return EngineConfig(model="tiny-m3", attention_backend="naive", num_pages=64, max_num_seqs=4,
                        max_num_batched_tokens=48, max_model_len=512)


def prefill_logits(engine: LLMEngine) -> torch.Tensor:
    """Logits [PREFILL, vocab] of one 100-token prompt on pages 0..6 of the engine's pool."""
    page = engine.page_size
    positions = torch.arange(PREFILL)
    meta = AttentionMetadata(
        positions=positions, slot_mapping=positions.clone(),
        block_tables=torch.arange(-(-PREFILL // page), dtype=torch.int32)[None],
        seq_lens=torch.tensor([PREFILL], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, PREFILL], dtype=torch.int32), max_query_len=PREFILL,
    )
    with torch.inference_mode():
        hidden = engine.runner.forward(torch.tensor(prompt(PREFILL, seed=1)), meta)
        return engine.model.compute_logits(hidden)


def greedy_tokens(engine: LLMEngine) -> dict[str, list[int]]:
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, length in enumerate((70, 9, 33)):
        engine.add_request(GenerateRequest(f"r{i}", prompt(length, seed=10 + i), sampling))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
    return tokens


def run_case(model: torch.nn.Module) -> dict:
    torch.manual_seed(0)
    engine = LLMEngine(engine_config(), model=model)
    logits = prefill_logits(engine)
    # a fresh pool: the prefill above wrote pages the engine's block manager does not know of
    engine = LLMEngine(engine_config(), model=model)
    return {"logits": logits, "tokens": greedy_tokens(engine),
            "kv_heads": model.config.num_kv_heads, "q_heads": model.config.num_heads}


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    out = Path(out_dir)
    if rank == 0:
        torch.save(run_case(random_m3()), out / "reference.pt")
    for tp, ep in LAYOUTS:
        groups = build_groups(ParallelLayout(tp, ep), rank)
        if groups is None:
            continue
        result = run_case(shard_m3_model(random_m3(), groups))
        torch.save(result, out / f"tp{tp}_ep{ep}_rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
