"""How much consecutive queries share their selected blocks on bench_msa.py's synthetic index data,
and what the sparse-prefill tile-dense option (benchmarks/kernels/tile_dense.py) would
do with it: partials per (query, KV head) the merge reads, and the masked MMA work it adds. CPU only.

    python benchmarks/kernels/msa_coselection.py --out benchmarks/results [--queries 2048]

Selections come from the naive indexer (block_scores + select_blocks) for queries inside the last
16K chunk of a 128K sequence, at the M3 index shape (Hkv=4 query heads, HkI=1, DI=128, P=128, K=16,
n_init=1); the plan is tile_dense.plan_tiles itself, so the counts are the ones the kernel would see.
"""

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from msa_baselines import index_keys, index_queries
from tile_dense import plan_tiles

from msaserve.kernels.indexer_prefill.naive import block_scores, select_blocks

P, HKV, HKI, DI, TOP_K, N_INIT = 128, 4, 1, 128, 16, 1
CONTEXT, CHUNK = 131072, 16384


def selections(num_queries: int) -> torch.Tensor:
    """[num_queries, Hkv, K] for positions from 4096 into the last chunk of CONTEXT."""
    keys = index_keys(CONTEXT // P, P, HKI, DI, device="cpu").reshape(CONTEXT, HKI, DI)
    first = CONTEXT - CHUNK + 4096
    q = index_queries(num_queries, first, P, HKV, DI, device="cpu")
    positions = torch.arange(first, first + num_queries)
    out = []
    for s in range(0, num_queries, 256):  # bounds the [256, Hkv, T] score tensor
        scores = block_scores(q[s:s + 256], keys[: first + num_queries], positions[s:s + 256], P)
        out.append(select_blocks(scores, positions[s:s + 256], P, TOP_K, N_INIT))
    return torch.cat(out)


def plan_row(selected: torch.Tensor, tile: int, share: float) -> dict:
    num_queries = selected.shape[0]
    seq = torch.zeros(num_queries, dtype=torch.int64)
    tail, _, dense_count, _, merge_valid = plan_tiles(selected, seq, CONTEXT // P, tile, share)
    queries_in_tile = torch.clamp(num_queries - torch.arange(dense_count.shape[0]) * tile, max=tile)
    chosen = int((selected >= 0).sum())
    computed = int((dense_count * queries_in_tile[:, None]).sum()) + int((tail >= 0).sum())
    union = [len(set(selected[t:t + tile, h].flatten().tolist()) - {-1})
             for t in range(0, num_queries, tile) for h in range(HKV)]
    return {"tile_queries": tile, "share": share, "union_blocks": sum(union) / len(union),
            "common_blocks": float(dense_count.float().mean()),
            "partials_per_query_head": float((merge_valid >= 0).sum(-1).float().mean()),
            "extra_mma": computed / chosen - 1.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--queries", type=int, default=2048)
    parser.add_argument("--git-revision", default="unknown")
    args = parser.parse_args()
    torch.manual_seed(0)
    selected = selections(args.queries)
    rows = [plan_row(selected, tile, share) for tile in (4, 8, 16, 32, 64, 128) for share in (0.5, 0.75, 1.0)]
    doc = {"command": f"python benchmarks/kernels/msa_coselection.py --queries {args.queries}",
           "hardware": f"CPU ({platform.machine()}), torch {torch.__version__}",
           "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "git_revision": args.git_revision, "partials_per_query_head_block_major": TOP_K, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "msa_coselection.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{args.queries} queries, K = {TOP_K} (block-major: {TOP_K} partials per query and KV head)")
    print(f"{'tile':>5} {'share':>6} {'union':>7} {'common':>7} {'partials':>9} {'extra MMA':>10}")
    for r in rows:
        print(f"{r['tile_queries']:>5} {r['share']:>6} {r['union_blocks']:>7.1f} {r['common_blocks']:>7.2f} "
              f"{r['partials_per_query_head']:>9.2f} {r['extra_mma']:>10.3f}")


if __name__ == "__main__":
    main()
