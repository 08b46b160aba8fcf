"""Decode indexer launch sweep at batch 8, 1M tokens (the M3 index shape: HkI=1, DI=128, P=128,
K=16, 4 query heads per key head): every (config, split count) for the bf16 scan and both fp8 scans,
each config pinned alone so the autotuner does not choose. Shows how far the autotuned pick is from
the best launch this Triton finds, and which knob the fp8 scans are short of.

    python benchmarks/kernels/sweep_indexer_decode.py --out DIR [--git-revision REV]

Splits: `waves` CTAs per SM over the whole grid (the kernel's heuristic uses 2). Extra configs beyond
the kernel's own list are tried too and marked `candidate`.
"""

import datetime
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from msa_baselines import bench_parser, decode_index_inputs, time_graph_ms
from msa_baselines import indexer_decode_config_name as config_name

from msaserve.kernels.indexer_decode import triton as idec

BATCH, CONTEXT, HKV, HKI, DI, P, TOP_K, N_INIT = 8, 1 << 20, 4, 1, 128, 128, 16, 1
# (PAGES, PREFETCH, num_warps, num_stages) not in the kernel's list
CANDIDATES = ((8, 0, 8, 2), (8, 0, 8, 3), (8, 1, 8, 1), (4, 0, 4, 4), (4, 1, 4, 1), (2, 0, 4, 4),
              (4, 0, 8, 4), (8, 0, 4, 2))
WAVES = (1, 2, 4)


def sweep_scan(name: str, fn, nbytes: int, configs: list, extra: list, sms: int) -> list[dict]:
    """The autotuned pick, then every config × waves pinned alone, for one scan."""
    kernel = idec._score_split_kernel
    kernel.configs, kernel.cache = configs, {}
    reference = fn()
    ms = time_graph_ms(fn)
    picked = next(iter(kernel.cache.values()), None)
    rows = [{"scan": name, "config": "autotuned: " + (config_name(picked) if picked else "?"), "waves": 2,
             "ms": ms, "tbps": nbytes / ms / 1e9, "same": True}]
    for cfg in configs + extra:
        for waves in WAVES:
            idec._num_splits = lambda b, h, m, dev, w=waves: max(1, min(triton.cdiv(w * sms, b * h), m))
            kernel.configs, kernel.cache = [cfg], {}
            row = {"scan": name, "config": config_name(cfg) + (" candidate" if cfg in extra else ""),
                   "waves": waves}
            try:
                ms = time_graph_ms(fn)
                row.update(ms=ms, tbps=nbytes / ms / 1e9, same=bool((fn() == reference).all()))
            except Exception as exc:  # a config that cannot compile here is a row, not the end
                row["error"] = repr(exc)
            rows.append(row)
            print(f"{name:18} {row['config']:52} waves={waves} {row.get('ms', float('nan')):.4f} ms "
                  f"{row.get('tbps', float('nan')):.3f} TB/s same={row.get('same')}", flush=True)
    return rows


def main() -> None:
    args = bench_parser(__doc__).parse_args()
    torch.manual_seed(0)
    d = decode_index_inputs(BATCH, CONTEXT, P, HKI, DI, HKV)
    q, keys, keys8, scale = d["q"], d["keys"], d["keys8"], d["scale"]
    tables, seq_lens = d["tables"], d["seq_lens"]
    scans = {"bf16": (lambda: idec.indexer_decode(q, keys, tables, seq_lens, TOP_K, N_INIT),
                      BATCH * CONTEXT * DI * 2)}
    for s in idec.FP8_SCANS:
        scans[f"fp8 {s}"] = (lambda s=s: idec.indexer_decode(q, keys8, tables, seq_lens, TOP_K, N_INIT, scale,
                                                             fp8_scan=s), BATCH * CONTEXT * (DI + 4))
    kernel, heuristic = idec._score_split_kernel, idec._num_splits
    own = list(kernel.configs)
    extra = [triton.Config({"PAGES": p, "PREFETCH": f}, num_warps=w, num_stages=s)
             for p, f, w, s in CANDIDATES]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    try:
        for name, (fn, nbytes) in scans.items():
            rows += sweep_scan(name, fn, nbytes, own, extra, sms)
    finally:
        idec._num_splits, kernel.configs, kernel.cache = heuristic, own, {}
    doc = {"command": "python benchmarks/kernels/sweep_indexer_decode.py --out benchmarks/results",
           "hardware": torch.cuda.get_device_name(), "git_revision": args.git_revision,
           "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "shape": {"batch": BATCH, "context": CONTEXT, "HkI": HKI, "DI": DI, "P": P, "top_k": TOP_K,
                     "query_heads_per_key_head": HKV},
           "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "indexer_decode_sweep.json").write_text(json.dumps(doc, indent=1))
    print(f"\n{'scan':18} {'launch':62} {'ms':>8} {'TB/s':>7}")
    for name in scans:
        ok = [r for r in rows if r["scan"] == name and "ms" in r]
        for r in [ok[0], *sorted(ok[1:], key=lambda r: r["ms"])[:4]]:
            print(f"{name:18} {r['config'] + ' waves=' + str(r['waves']):62} {r['ms']:8.4f} {r['tbps']:7.3f}")


if __name__ == "__main__":
    main()
