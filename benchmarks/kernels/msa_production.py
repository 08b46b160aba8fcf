"""MiniMax's 128 production prefill shapes (benchmarks/data/msa_prefill_benchmark_cases_v1.json)
through the MSA prefill kernels (indexer + selection + sparse attention), weighted as its README says.

Per-sequence lengths are not in the file; the rule used (printed with the results):
  queries: total_q split evenly over the batch (the first total_q % B sequences get one more);
  final KV: sequence 0 gets max_final_kv, every other sequence a length drawn uniformly from
  [its query count, max_final_kv] with torch.Generator seeded 1000 + case index.
useful_flops = 2·128·128·Σ over query rows of floor(position / 128), recomputed for these lengths.
Aggregate over representative cases only: Σ w·useful_flops / Σ w·latency (w = representative_weight).

Each op is timed twice: as one eager call, event-timed (`indexer_ms`, `sparse_ms`: the headline,
host launch work included, as an engine that launches each layer's ops one by one pays it), and
replayed as a CUDA graph (`*_device_ms`: the device's time alone, as an engine that captures its
prefill step would pay it). `launch_ms` is the difference: the host time the device waits for. The
indexer's time includes its top-k (fused in its kernels); the sparse attention's includes the
selection inversion and the partials' merge.
"""

import json
from pathlib import Path

import torch
from msa_baselines import index_keys, index_queries, time_graph_ms, time_ms
from msa_report import Report

HQ, HKV, D, HKI, DI, P, TOP_K, N_INIT = 64, 4, 128, 1, 128, 128, 16, 1
BF16 = torch.bfloat16
RULE = __doc__.split("Per-sequence lengths are not in the file; the rule used (printed with the results):")[1]


def case_lengths(case: dict, index: int) -> tuple[list[int], list[int]]:
    """→ (query tokens per sequence, final KV length per sequence) by the rule above."""
    batch, total_q, max_kv = case["batch_size"], case["total_q"], case["max_final_kv"]
    queries = [total_q // batch + (1 if b < total_q % batch else 0) for b in range(batch)]
    gen = torch.Generator().manual_seed(1000 + index)
    finals = [max_kv] + [int(torch.randint(q, max_kv + 1, (1,), generator=gen)) for q in queries[1:]]
    return queries, [max(f, q) for f, q in zip(finals, queries, strict=True)]


def useful_flops(queries: list[int], finals: list[int]) -> float:
    total = 0
    for q, f in zip(queries, finals, strict=True):
        pos = torch.arange(f - q, f, dtype=torch.int64)
        total += int((pos // P).sum())
    return 2.0 * P * P * total


def _run_case(ops, pool: dict, case: dict, index: int) -> dict:
    queries, finals = case_lengths(case, index)
    pages = [(f + P - 1) // P for f in finals]
    perm = torch.randperm(pool["k"].shape[0], device="cuda")[: sum(pages)].to(torch.int32)
    tables = torch.full((len(finals), max(pages)), -1, dtype=torch.int32, device="cuda")
    offset = 0
    for b, n in enumerate(pages):
        tables[b, :n] = perm[offset:offset + n]
        offset += n
    seq_lens = torch.tensor(finals, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total_q = sum(queries)
    q = torch.randn(total_q, HQ, D, device="cuda", dtype=BF16)
    q_index = torch.cat([index_queries(q, f - q, P, HKV, DI) for q, f in zip(queries, finals, strict=True)])

    def indexer() -> torch.Tensor:
        return ops.indexer_prefill(q_index, pool["index"], tables, seq_lens, cu, TOP_K, N_INIT)

    def sparse() -> torch.Tensor:
        return ops.sparse_prefill(q, pool["k"], pool["v"], tables, seq_lens, cu, selected)

    selected = indexer()
    t_idx = time_ms(indexer, reps=3, warmup=1)
    t_sp = time_ms(sparse, reps=3, warmup=1)
    t_idx_dev = time_graph_ms(indexer, reps=5, warm_s=0.02)
    t_sp_dev = time_graph_ms(sparse, reps=5, warm_s=0.02)
    return {"case": case["case_id"][-8:], "batch": len(finals), "total_q": total_q, "max_kv": max(finals),
            "weight": case.get("representative_weight", 0), "indexer_ms": t_idx, "sparse_ms": t_sp,
            "total_ms": t_idx + t_sp, "indexer_device_ms": t_idx_dev, "sparse_device_ms": t_sp_dev,
            "total_device_ms": t_idx_dev + t_sp_dev,
            "launch_ms": max(0.0, t_idx + t_sp - t_idx_dev - t_sp_dev),
            "useful_flops": useful_flops(queries, finals), "file_useful_flops": float(case["useful_flops"])}


def bench_production(report: Report, ops, cases_path: Path) -> None:
    cases = json.loads(cases_path.read_text())["cases"]
    max_tokens = max(sum(case_lengths(c, i)[1]) + P * c["batch_size"] for i, c in enumerate(cases))
    num_pages = max_tokens // P + 1
    pool = {"k": torch.randn(num_pages, P, HKV, D, device="cuda", dtype=BF16),
            "v": torch.randn(num_pages, P, HKV, D, device="cuda", dtype=BF16),
            "index": index_keys(num_pages, P, HKI, DI)}
    rows = [_run_case(ops, pool, c, i) for i, c in enumerate(cases)]
    rep = [r for r in rows if r["weight"]]
    weight = sum(r["weight"] for r in rep)
    flops = sum(r["weight"] * r["useful_flops"] for r in rep)

    def aggregate(key: str) -> float:
        return flops / sum(r["weight"] * r[key] * 1e-3 for r in rep) / 1e12

    mean_latency = sum(r["weight"] * r["total_ms"] for r in rep) / weight
    report.notes.append("production prefill: per-sequence length rule:" + " ".join(RULE.split()))
    mean_device = sum(r["weight"] * r["total_device_ms"] for r in rep) / weight
    shares = {part: sum(r["weight"] * r[key] for r in rep) / weight / mean_latency
              for part, key in (("indexer_device", "indexer_device_ms"),
                                ("sparse_device", "sparse_device_ms"), ("launch", "launch_ms"))}
    report.metric("production_prefill_tflops", aggregate("total_ms"), "TFLOP/s",
                  "report (useful_flops / (indexer + sparse attention) latency)",
                  cases=len(rows), representative_cases=len(rep), represented_calls=weight,
                  weighted_mean_latency_ms=mean_latency, sparse_only_tflops=aggregate("sparse_ms"),
                  indexer_only_tflops=aggregate("indexer_ms"), rule=" ".join(RULE.split()),
                  share_of_latency={k: round(v, 4) for k, v in shares.items()})
    report.metric("production_prefill_tflops_device", aggregate("total_device_ms"), "TFLOP/s",
                  "report (the same, each op replayed as a CUDA graph: device time, no host launch work)",
                  representative_cases=len(rep), weighted_mean_latency_ms=mean_device,
                  sparse_only_tflops=aggregate("sparse_device_ms"),
                  indexer_only_tflops=aggregate("indexer_device_ms"))
    for r in sorted(rows, key=lambda r: -r["weight"])[:12]:
        shown = {k: v for k, v in r.items() if k != "file_useful_flops"}
        report.row("production (top 12 by weight)", **shown)
    report.raw["production_all_cases"] = rows
    pool.clear()
    torch.cuda.empty_cache()
