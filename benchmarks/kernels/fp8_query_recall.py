"""Would an fp8 index *query* keep the decode selection? Recall of the top-K blocks chosen with the
query cut to fp8, against the exact query, on bench_msa.py's synthetic decode inputs. CPU only.

    python benchmarks/kernels/fp8_query_recall.py --out benchmarks/results [--sequences 4]

Why: the fp8 decode scan ("split-query", indexer_decode/triton.py) runs two fp8 MMAs per page, one
per fp8 term of the query, which is exact for bf16 queries. A one-term query would halve the MMAs;
issue 25 allows fp8 index queries where the selection recall against bf16 is ≥ 99 % on the test
inputs. Selections are the spec's (naive block_scores + select_blocks, n_init=1, n_local=1) for the
last position of a sequence, at the M3 index shape (Hkv=4 query heads, HkI=1, DI=128, P=128, K=16).

Rows (recall = |chosen ∩ reference| / K, mean over sequences and heads; the forced blocks count):
- fp8 keys (per-token scale), exact query, against bf16 keys: what the fp8 index itself costs;
- against fp8 keys with the exact query, each query form: "two terms" (the kernel's split, exact
  for bf16: must read 1.0), "one term, rounded" (e4m3 with a per-row scale amax/448, round to
  nearest even) and "one term, truncated" (the split's first term alone).
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

from msaserve.kernels.indexer_prefill.naive import block_scores, select_blocks

P, HKV, HKI, DI, TOP_K, N_INIT = 128, 4, 1, 128, 16, 1
E4M3_MAX = 448.0
TARGET = 0.99


def fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """x cut to e4m3 with a scale per last-axis row (round to nearest even), returned dequantized."""
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


def truncated_terms(q: torch.Tensor, terms: int) -> torch.Tensor:
    """The kernel's split of q into `terms` fp8 terms (4 significant bits each, cut, not rounded),
    summed back: q / s = t0 + t1/16 + …, s a power of two that puts the row's max below 256."""
    exp = torch.frexp(q.abs().amax(-1, keepdim=True).clamp(min=1e-30)).exponent  # amax < 2^exp
    scale = torch.exp2((exp - 8).float())
    x, total, weight = q / scale, torch.zeros_like(q), 1.0
    for _ in range(terms):
        term = (x.view(torch.int32) & -1048576).view(torch.float32)  # sign, exponent, 3 mantissa bits
        total, x, weight = total + term * weight, (x - term) * 16.0, weight / 16.0
    return total * scale


def select(q: torch.Tensor, keys: torch.Tensor, position: int) -> torch.Tensor:
    """[Hkv, K] block ids chosen for the query at `position` (the last of the sequence)."""
    positions = torch.tensor([position])
    scores = block_scores(q[None], keys, positions, P)
    return select_blocks(scores, positions, P, TOP_K, N_INIT)[0]


def recall(chosen: torch.Tensor, reference: torch.Tensor) -> list[float]:
    return [len(set(c.tolist()) & set(r.tolist())) / TOP_K for c, r in zip(chosen, reference, strict=True)]


def measure(context: int, sequences: int) -> dict:
    rows: dict[str, list[float]] = {"fp8 keys vs bf16 keys (exact query)": [], "two terms": [],
                                    "one term, rounded": [], "one term, truncated": []}
    for _ in range(sequences):
        keys = index_keys(context // P, P, HKI, DI, device="cpu").float().reshape(context, HKI, DI)
        q = index_queries(1, context - 1, P, HKV, DI, device="cpu").float()[0]  # [Hkv, DI]
        fp8_keys = fp8_rows(keys)
        exact = select(q, fp8_keys, context - 1)
        rows["fp8 keys vs bf16 keys (exact query)"] += recall(exact, select(q, keys, context - 1))
        for name, cut in (("two terms", truncated_terms(q, 2)), ("one term, rounded", fp8_rows(q)),
                          ("one term, truncated", truncated_terms(q, 1))):
            rows[name] += recall(select(cut, fp8_keys, context - 1), exact)
    return {name: {"mean": sum(v) / len(v), "min": min(v), "rows": len(v)} for name, v in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--sequences", type=int, default=4, help="sequences per context (4 heads each)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[131072, 1048576])
    parser.add_argument("--git-revision", default="unknown")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {str(c): measure(c, args.sequences) for c in args.contexts}
    doc = {"command": "python benchmarks/kernels/fp8_query_recall.py "
                      f"--sequences {args.sequences} --contexts {' '.join(map(str, args.contexts))}",
           "hardware": f"CPU ({platform.machine()}), torch {torch.__version__}",
           "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "git_revision": args.git_revision, "target_recall": TARGET, "top_k": TOP_K, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_query_recall.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"recall of the top-{TOP_K} selection (mean / min over rows; target for an fp8 query ≥ {TARGET})")
    print(f"{'context':>9}  {'form':<38} {'mean':>6} {'min':>6} {'rows':>5}")
    for context, rows in results.items():
        for name, r in rows.items():
            print(f"{context:>9}  {name:<38} {r['mean']:>6.3f} {r['min']:>6.3f} {r['rows']:>5}")


if __name__ == "__main__":
    main()
