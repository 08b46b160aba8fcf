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
from msaserve.engine.parallel.moves import receive_session, send_session
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
    move_between_tp2_replicas(rank, out)
    dist.barrier()
    dist.destroy_process_group()


def greedy_step(engine: LLMEngine, ids: list[int], start: int, block_table: list[int]) -> int:
    """Run ids at positions start.. of a sequence with `block_table` → the greedy next token."""
    page, n = engine.page_size, len(ids)
    positions = torch.arange(start, start + n)
    table = torch.tensor(block_table)
    meta = AttentionMetadata(
        positions=positions, slot_mapping=table[positions // page] * page + positions % page,
        block_tables=table.to(torch.int32)[None], seq_lens=torch.tensor([start + n], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), max_query_len=n,
        decode_query_len=1 if n == 1 else None,
    )
    with torch.inference_mode():
        hidden = engine.runner.forward(torch.tensor(ids), meta)
        return int(engine.model.compute_logits(hidden[-1:]).argmax())


def decode(engine: LLMEngine, tokens: list[int], table: list[int], steps: int) -> list[int]:
    out = []
    for _ in range(steps):
        out.append(greedy_step(engine, tokens[-1:], len(tokens) - 1, table))
        tokens.append(out[-1])
    return out


def move_between_tp2_replicas(rank: int, out: Path) -> None:
    """Ranks 0-1 are one TP 2 replica, ranks 2-3 another. The first prefills 70 tokens and
    decodes 4, then rank i sends its shard of the session to rank i + 2; both replicas decode 8
    more tokens (the target on other physical pages, in another order) and must agree."""
    layout = ParallelLayout(2, 1)
    source, target = build_groups(layout, rank, offset=0), build_groups(layout, rank, offset=2)
    groups = source if rank < 2 else target
    engine = LLMEngine(engine_config(), model=shard_m3_model(random_m3(), groups))
    if rank < 2:
        tokens, table = prompt(70, seed=5), [0, 1, 2, 3, 4, 5]  # 86 tokens fit 6 pages of 16
        tokens.append(greedy_step(engine, tokens, 0, table))
        decode(engine, tokens, table, 3)
        send_session(engine.runner.caches, table[: -(-(len(tokens) - 1) // 16)], tokens, dst=rank + 2)
        continued = decode(engine, tokens, table, 8)
    else:
        spread = lambda n: [40 - 3 * i for i in range(n)]  # noqa: E731 (other pages, reversed)
        tokens, table = receive_session(engine.runner.caches, spread, src=rank - 2)
        table.append(7)  # the page the continuation grows into
        continued = decode(engine, tokens, table, 8)
    torch.save(continued, out / f"move_rank{rank}.pt")
