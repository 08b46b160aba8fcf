"""MSA decode against the best dense decode over MiniMax's decode grid (issue 25 item 3): batch
8 / 32 / 64 / 128 x context 1K ... 200K, with 1 query per request and with 8 (multi-token prediction
or speculative verify: causal within the 8). M3 shape (Hq 64, Hkv 4, D 128, one index head of 128,
P 128, top-16, bf16 KV). One layer.

    python benchmarks/kernels/bench_decode_suite.py --out DIR [--git-revision REV] [--budget-s S]

Per case: the MSA step (decode indexer over the index cache, bf16 keys and fp8 keys, then sparse
attention over the selected blocks), each a CUDA graph replayed (median); the best dense decode of
the same queries over the same K/V: the paged flash-decoding kernel on the paged cache, and, where
a contiguous copy of K and V fits (--contiguous-gb), SDPA's cuDNN / flash / efficient backends,
SDPA's own choice, and the split (mask-free + causal square, LSE-merged) cuDNN / flash forms on it
(graph-replayed too; FlexAttention and flash-attn-4 are left out here: they compile per shape, and
bench_dense.py times them at 1M). Bandwidth = bytes that must be read (index
keys, the distinct selected KV blocks; dense: all of K and V) over the time. Writes
DIR/decode_suite.json (`kernels.decode_suite`: the table; value = median bf16-index ratio).
"""

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dense_baseline import NOT_COMPILED, PAGED, best_dense, graph_timer, paged_call, to_pages
from msa_baselines import index_keys, time_graph_ms

from msaserve.kernels.dense.select import Choice
from msaserve.kernels.dispatch import get_ops

HQ, HKV, D, HKI, DI, P, TOP_K, N_INIT = 64, 4, 128, 1, 128, 128, 16, 1
BF16 = torch.bfloat16
OPS = get_ops("triton", "cuda")


def distinct_blocks(selected: torch.Tensor) -> int:
    """selected [B, Q, Hkv, K] → Σ over (sequence, KV head) of the distinct valid blocks."""
    batch, num_q, kv_heads, top_k = selected.shape
    ids = selected.permute(0, 2, 1, 3).reshape(batch, kv_heads, num_q * top_k).sort(-1).values
    new = torch.ones_like(ids, dtype=torch.bool)
    new[..., 1:] = ids[..., 1:] != ids[..., :-1]
    return int((new & (ids >= 0)).sum())


def caches(batch: int, context: int, contiguous: bool) -> dict:
    pages = context // P
    c = {"tables": torch.arange(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages),
         "seq_lens": torch.full((batch,), context, device="cuda", dtype=torch.int32)}
    if contiguous:  # the paged cache is a copy of the contiguous K/V: both sides read the same values
        c["k"] = torch.randn(batch, HKV, context, D, device="cuda", dtype=BF16)
        c["v"] = torch.randn_like(c["k"])
        c["k_cache"], c["v_cache"] = to_pages(c["k"]), to_pages(c["v"])
    else:
        c["k_cache"] = torch.randn(batch * pages, P, HKV, D, device="cuda", dtype=BF16)
        c["v_cache"] = torch.randn_like(c["k_cache"])
    c["index"] = index_keys(batch * pages, P, HKI, DI)
    c["scale"] = c["index"].float().abs().amax(-1).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    c["index8"] = (c["index"].float() / c["scale"][..., None]).to(torch.float8_e4m3fn)
    return c


def run_case(batch: int, context: int, num_q: int, contiguous_gb: float) -> dict:
    kv_gb = 2 * batch * context * HKV * D * 2 / 1e9
    c = caches(batch, context, contiguous=kv_gb <= contiguous_gb)
    q = torch.randn(batch, num_q, HQ, D, device="cuda", dtype=BF16)
    q_index = torch.randn(batch, num_q, HKV, DI, device="cuda", dtype=BF16)
    tables, seq_lens = c["tables"], c["seq_lens"]

    def indexer(fp8: bool) -> torch.Tensor:
        if fp8:
            return OPS.indexer_decode(q_index, c["index8"], tables, seq_lens, TOP_K, N_INIT, c["scale"])
        return OPS.indexer_decode(q_index, c["index"], tables, seq_lens, TOP_K, N_INIT)

    def step(fp8: bool) -> torch.Tensor:
        return OPS.sparse_decode(q, c["k_cache"], c["v_cache"], tables, seq_lens, indexer(fp8))

    selected = indexer(False)
    t_step, t_step8 = time_graph_ms(lambda: step(False)), time_graph_ms(lambda: step(True))
    scale = D ** -0.5
    q_sdpa = q.transpose(1, 2).contiguous()  # [B, Hq, Q, D]
    paged = paged_call(q_sdpa, c["k_cache"], c["v_cache"], tables, seq_lens, scale)
    if "k" in c:
        dense = best_dense(q_sdpa, c["k"], c["v"], paged=paged, only=NOT_COMPILED, timer=graph_timer())
    else:
        dense = Choice(PAGED, {PAGED: time_graph_ms(paged)}, {"contiguous": f"skipped: K+V {kv_gb:.0f} GB"})
    t_dense = dense.times_ms[dense.winner]
    index_bytes = batch * context * HKI * DI * 2
    index8_bytes = batch * context * HKI * (DI + 4)
    sel_bytes = distinct_blocks(selected) * P * D * 2 * 2
    row = {"batch": batch, "context": context, "q_per_request": num_q, "msa_ms": t_step,
           "msa_fp8_ms": t_step8, "dense_ms": t_dense, "dense_winner": dense.winner,
           "ratio": t_dense / t_step,
           "ratio_fp8": t_dense / t_step8, "msa_tbps": (index_bytes + sel_bytes) / t_step / 1e9,
           "msa_fp8_tbps": (index8_bytes + sel_bytes) / t_step8 / 1e9,
           "dense_tbps": kv_gb * 1e9 / t_dense / 1e9, "dense_candidates_ms": dense.times_ms,
           "dense_errors": dense.errors}
    c.clear()
    torch.cuda.empty_cache()
    return row


def print_table(rows: list[dict]) -> None:
    print("\n== decode suite (ms; ratio = best dense / MSA step; TB/s = bytes that must be read / time)")
    head = ("batch", "context", "q", "msa", "msa_fp8", "dense", "winner", "ratio", "ratio_fp8", "msa_TB/s",
            "dense_TB/s")
    print(" ".join(f"{h:>12}" for h in head))
    for r in rows:
        if "skipped" in r:
            print(f"{r['batch']:>12} {r['context']:>12} {r['q_per_request']:>12} skipped: {r['skipped']}")
            continue
        cells = (r["batch"], r["context"], r["q_per_request"], f"{r['msa_ms']:.4f}", f"{r['msa_fp8_ms']:.4f}",
                 f"{r['dense_ms']:.4f}", r["dense_winner"], f"{r['ratio']:.2f}", f"{r['ratio_fp8']:.2f}",
                 f"{r['msa_tbps']:.2f}", f"{r['dense_tbps']:.2f}")
        print(" ".join(f"{x!s:>12}" for x in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--git-revision", default="unknown")
    parser.add_argument("--batches", default="8,32,64,128")
    parser.add_argument("--contexts", default="1024,4096,16384,65536,131072,204800")
    parser.add_argument("--queries", default="1,8")
    parser.add_argument("--contiguous-gb", type=float, default=24.0,
                        help="time the SDPA candidates where K+V take at most this many GB")
    parser.add_argument("--budget-s", type=float, default=1e9)
    args = parser.parse_args()
    torch.manual_seed(0)
    started, rows = time.time(), []
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            for num_q in map(int, args.queries.split(",")):
                case = {"batch": batch, "context": context, "q_per_request": num_q}
                if time.time() - started > args.budget_s:
                    rows.append({**case, "skipped": f"past the {args.budget_s:.0f} s budget"})
                    continue
                try:
                    rows.append(run_case(batch, context, num_q, args.contiguous_gb))
                except Exception as exc:  # a failed case is reported, the others still run
                    rows.append({**case, "skipped": f"failed: {exc!r}"[:300]})
                    torch.cuda.empty_cache()
                print(json.dumps(rows[-1], default=str), flush=True)
                write(args, rows)  # after every case: a run cut short keeps what it measured
    print_table(rows)


def write(args: argparse.Namespace, rows: list[dict]) -> None:
    done = [r["ratio"] for r in rows if "ratio" in r]
    entry = {"value": round(statistics.median(done), 4) if done else float("nan"),
             "unit": "x (median over the cases of best dense / MSA step, bf16 index)", "target": "report",
             "command": "python " + " ".join(sys.argv), "hardware": torch.cuda.get_device_name(),
             "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
             "git_revision": args.git_revision, "table": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_suite.json").write_text(json.dumps({"kernels.decode_suite": entry}, indent=1,
                                                           default=str))


if __name__ == "__main__":
    main()
