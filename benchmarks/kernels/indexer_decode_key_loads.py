"""Decode indexer: how a key page reaches the MMA, measured at the M3 index shape (HkI=1, DI=128,
P=128, K=16, 4 query heads per key head), 1 query per sequence.

    python benchmarks/kernels/indexer_decode_key_loads.py --out DIR [--git-revision REV]

Variants (`key_load`), each for bf16 keys and fp8 keys (the default fp8 scan):
- pointer: per-element addresses, the kernel's original path;
- tma: one TMA box [P, DI] per page into shared memory.
The kernel's "auto" default picks the faster per key dtype. Each is timed autotuned (CUDA graph
replays), then every TMA config pinned alone. The selection of every variant is compared with the
pointer path's (`same`). Index bytes read per second (`tbps`) count keys plus fp8 scales.

An earlier version (git 1ddb50a) also timed the TMA copies with the query rows on the MMA's M side
and the page's tokens on N: bf16 tied (0.492 ms at 1M x 8), fp8 was slower (2.59 against 2.97 TB/s),
so that variant was removed.
"""

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from msa_baselines import copy_bandwidth_tbps, index_keys, index_queries, time_graph_ms

from msaserve.kernels.indexer_decode import triton as idec

HKV, HKI, DI, P, TOP_K, N_INIT = 4, 1, 128, 128, 16, 1
CASES = ((8, 1 << 20), (32, 1 << 17))  # (batch, context)
VARIANTS = ("pointer", "tma")
# (PAGES, num_warps, num_stages) pinned for the TMA variants
PINNED = ((1, 4, 3), (1, 4, 4), (1, 4, 6), (2, 4, 3), (2, 4, 4), (4, 4, 2),
          (1, 8, 4), (2, 8, 3), (4, 8, 2))


def config_name(cfg: triton.Config | None) -> str:
    if cfg is None:
        return "?"
    kw = cfg.kwargs
    return f"PAGES={kw['PAGES']} PREFETCH={kw['PREFETCH']} warps={cfg.num_warps} stages={cfg.num_stages}"


def inputs(batch: int, context: int) -> dict:
    pages_per_seq = context // P
    num_pages = batch * pages_per_seq
    tables = torch.randperm(num_pages, device="cuda").to(torch.int32).view(batch, pages_per_seq)
    keys = index_keys(num_pages, P, HKI, DI)
    scale = keys.float().abs().amax(-1).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    keys8 = (keys.float() / scale[..., None]).to(torch.float8_e4m3fn)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = index_queries(batch, context - 1, P, HKV, DI).view(batch, 1, HKV, DI)
    return {"bf16": (q, keys, tables, seq_lens, None, batch * context * DI * 2),
            "fp8": (q, keys8, tables, seq_lens, scale, batch * context * (DI + 4))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--git-revision", default="unknown")
    args = parser.parse_args()
    torch.manual_seed(0)
    kernel = idec._score_split_kernel
    own = list(kernel.configs)
    copy = copy_bandwidth_tbps()
    rows = []
    try:
        for batch, context in CASES:
            for keys_name, (q, keys, tables, seq_lens, scale, nbytes) in inputs(batch, context).items():
                reference = None
                for key_load in VARIANTS:
                    def fn(key_load=key_load, q=q, keys=keys, tables=tables, seq_lens=seq_lens, scale=scale):
                        return idec.indexer_decode(q, keys, tables, seq_lens, TOP_K, N_INIT, scale,
                                                   key_load=key_load)

                    pinned = [None] + ([] if key_load == "pointer" else
                                       [triton.Config({"PAGES": p, "PREFETCH": 0}, num_warps=w, num_stages=s)
                                        for p, w, s in PINNED])
                    for cfg in pinned:
                        kernel.configs, kernel.cache = (own if cfg is None else [cfg]), {}
                        row = {"batch": batch, "context": context, "keys": keys_name, "variant": key_load}
                        try:
                            out = fn()
                            reference = out if reference is None else reference
                            ms = time_graph_ms(fn)
                            picked = next(iter(kernel.cache.values()), None) if cfg is None else cfg
                            row.update(config=("autotuned: " if cfg is None else "") + config_name(picked),
                                       ms=ms, tbps=nbytes / ms / 1e9, same=bool((out == reference).all()))
                        except Exception as exc:  # a config that cannot compile here is a row, not the end
                            row.update(config=config_name(cfg), error=repr(exc)[:300])
                        rows.append(row)
                        print(f"{batch:3} x {context:8} {keys_name:5} {key_load:8} {row['config']:60} "
                              f"{row.get('ms', float('nan')):.4f} ms "
                              f"{row.get('tbps', float('nan')):.3f} TB/s same={row.get('same')}", flush=True)
    finally:
        kernel.configs, kernel.cache = own, {}
    doc = {"command": "python benchmarks/kernels/indexer_decode_key_loads.py --out benchmarks/results",
           "hardware": torch.cuda.get_device_name(), "git_revision": args.git_revision,
           "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "copy_tbps": copy, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "indexer_decode_key_loads.json").write_text(json.dumps(doc, indent=1))
    print(f"\ncopy bandwidth {copy:.2f} TB/s")
    print(f"{'case':16} {'keys':5} {'variant':14} {'autotuned ms':>12} {'TB/s':>6} "
          f"{'best pinned':60} {'ms':>7}")
    for batch, context in CASES:
        for keys_name in ("bf16", "fp8"):
            for variant in VARIANTS:
                mine = [r for r in rows if (r["batch"], r["context"], r["keys"], r["variant"])
                        == (batch, context, keys_name, variant) and "ms" in r]
                if not mine:
                    print(f"{batch} x {context:<10} {keys_name:5} {variant:14} failed")
                    continue
                auto, best = mine[0], min(mine, key=lambda r: r["ms"])
                print(f"{batch} x {context:<10} {keys_name:5} {variant:14} {auto['ms']:12.4f} "
                      f"{auto['tbps']:6.2f} {best['config']:60} {best['ms']:7.4f}")


if __name__ == "__main__":
    main()
