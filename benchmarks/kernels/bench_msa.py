"""MSA kernels on one GPU at the M3 attention shape (issue 3, Measure): Hq=64, Hkv=4, D=128, HkI=1,
DI=128, P=128, K=16, n_init=1, bf16. One layer. Every figure is a ratio against baselines timed in
the same run (dense causal SDPA flash, flex_attention with the same selection, the naive ops), with
the physical floors (bytes ÷ measured copy bandwidth, FLOPs ÷ measured bf16 GEMM rate) beside it.

    python benchmarks/kernels/bench_msa.py --out DIR [--git-revision REV] [--skip-1m-prefill]

Index queries are drawn per 128-query tile plus per-token noise, so neighbouring queries choose
overlapping blocks as real ones do (a purely random index makes every tile's union dense).

The decode table's fp8 columns use the indexer's default fp8 scan ("split-query": keys as stored,
query split into fp8 terms); the `*_widen` columns time the other one ("widen-keys": keys widened
to fp16) on the same data, and `widen_same_rows` is the share of rows whose selections agree
exactly (near-ties may swap). The `*_tma` columns time the bf16 scan with
its key pages copied by TMA (key_load="tma"; the default gathers them through pointers) on the same data.
"""

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dense_baseline import NOT_COMPILED, best_dense, candidate_row, graph_timer
from msa_baselines import (
    FlexMSA,
    copy_bandwidth_tbps,
    flex,
    gemm_tflops,
    index_keys,
    indexer_causal_flops,
    time_graph_ms,
    time_ms,
)
from msa_baselines import index_queries as synthetic_queries
from msa_production import bench_production
from msa_report import Report
from tile_dense import plan_tiles, queries_per_tile, sparse_prefill_tile_dense

from msaserve.kernels.dense.candidates import fa4_available
from msaserve.kernels.dense.select import Choice
from msaserve.kernels.dispatch import get_ops
from msaserve.kernels.indexer_decode.triton import DEFAULT_FP8_SCAN, DEFAULT_KEY_LOAD, FP8_SCANS, KEY_LOADS

HQ, HKV, D, HKI, DI, P, TOP_K, N_INIT = 64, 4, 128, 1, 128, 128, 16, 1
BF16 = torch.bfloat16
CHUNK = 16384
TRITON = get_ops("triton", "cuda")
EXPLORE = True  # --no-explore: headline figures only (no naive ops, profiles, A/B kernel variants)
NAIVE = get_ops("naive", "cuda")


def index_queries(num_tokens: int, first_pos: int) -> torch.Tensor:
    return synthetic_queries(num_tokens, first_pos, P, HKV, DI)


def paged_caches(num_pages: int, fp8: bool = False) -> dict:
    caches = {
        "k": torch.randn(num_pages, P, HKV, D, device="cuda", dtype=BF16),
        "v": torch.randn(num_pages, P, HKV, D, device="cuda", dtype=BF16),
        "index": index_keys(num_pages, P, HKI, DI),
    }
    if fp8:
        scale = caches["index"].float().abs().amax(-1).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
        caches["index_fp8"] = (caches["index"].float() / scale[..., None]).to(torch.float8_e4m3fn)
        caches["index_scale"] = scale
    return caches


# ---------------------------------------------------------------- decode


# The fp8 scan that is not the default, timed beside it on the same data; its decode-table columns
# carry this short name (indexer_fp8_widen_ms, ...).
OTHER_FP8_SCAN = next(s for s in FP8_SCANS if s != DEFAULT_FP8_SCAN)
OTHER_SCAN_TAG = {"widen-keys": "widen", "split-query": "splitq"}[OTHER_FP8_SCAN]
# The bf16 key load that is not the default; its columns are indexer_tma_ms, step_tma_ms, ...
OTHER_KEY_LOAD = next(k for k in KEY_LOADS if k != DEFAULT_KEY_LOAD)


def _other_scan_ab(report: Report, indexer, sparse) -> tuple[float, float, float]:
    """The other fp8 scan (OTHER_FP8_SCAN) on the same data: indexer ms, step ms, share of rows
    selecting exactly as the default scan. NaNs and a note if it fails, so the default path's row is
    still written."""
    try:
        t_idx = time_graph_ms(lambda: indexer(True, OTHER_FP8_SCAN))
        t_step = time_graph_ms(lambda: sparse(indexer(True, OTHER_FP8_SCAN)))
        same = (indexer(True, OTHER_FP8_SCAN) == indexer(True)).all(-1).float().mean().item()
        return t_idx, t_step, same
    except Exception as exc:  # an A/B variant failing must not lose the measured row
        report.notes.append(f"fp8 {OTHER_FP8_SCAN} A/B failed: {exc!r}")
        traceback.print_exc()
        return float("nan"), float("nan"), float("nan")


def bench_decode(report: Report, ceil: dict, context: int, batch: int, naive: bool = False) -> None:
    pages_per_seq = context // P
    num_pages = batch * pages_per_seq
    tables = torch.randperm(num_pages, device="cuda").to(torch.int32).view(batch, pages_per_seq)
    c = paged_caches(num_pages, fp8=True)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, 1, HQ, D, device="cuda", dtype=BF16)
    q_index = index_queries(batch, context - 1).view(batch, 1, HKV, DI)
    ops = TRITON

    def indexer(fp8: bool, fp8_scan: str = DEFAULT_FP8_SCAN,
                key_load: str = DEFAULT_KEY_LOAD) -> torch.Tensor:
        if fp8:
            return ops.indexer_decode(q_index, c["index_fp8"], tables, seq_lens, TOP_K, N_INIT,
                                      c["index_scale"], fp8_scan=fp8_scan)
        return ops.indexer_decode(q_index, c["index"], tables, seq_lens, TOP_K, N_INIT, key_load=key_load)

    selected = indexer(False)
    if context == 1 << 20 and EXPLORE:
        _profile(lambda: indexer(True), "decode indexer fp8, 1M x 8")
    t_idx = time_graph_ms(lambda: indexer(False))
    t_idx8 = time_graph_ms(lambda: indexer(True))
    t_sparse = time_graph_ms(lambda: ops.sparse_decode(q, c["k"], c["v"], tables, seq_lens, selected))
    t_step = time_graph_ms(lambda: ops.sparse_decode(q, c["k"], c["v"], tables, seq_lens, indexer(False)))
    t_step8 = time_graph_ms(lambda: ops.sparse_decode(q, c["k"], c["v"], tables, seq_lens, indexer(True)))
    t_idx8o, t_step8o, same_rows = _other_scan_ab(report, indexer, lambda sel: ops.sparse_decode(
        q, c["k"], c["v"], tables, seq_lens, sel))
    # bf16 keys through the key load that is not the default (OTHER_KEY_LOAD), same data.
    t_idxl = time_graph_ms(lambda: indexer(False, key_load=OTHER_KEY_LOAD))
    t_stepl = time_graph_ms(lambda: ops.sparse_decode(q, c["k"], c["v"], tables, seq_lens,
                                                      indexer(False, key_load=OTHER_KEY_LOAD)))
    t_naive = float("nan")
    if naive:
        def naive_step() -> torch.Tensor:
            sel = NAIVE.indexer_decode(q_index, c["index"], tables, seq_lens, TOP_K, N_INIT)
            return NAIVE.sparse_decode(q, c["k"], c["v"], tables, seq_lens, sel)

        t_naive = time_ms(naive_step, reps=1, warmup=1)
    c.clear()  # free the paged caches before the dense baseline's copies
    torch.cuda.empty_cache()
    kv = {"k": torch.randn(batch, HKV, context, D, device="cuda", dtype=BF16)}
    kv["v"] = torch.randn_like(kv["k"])
    qd = q.view(batch, HQ, 1, D)
    only = None if context == 1 << 20 else NOT_COMPILED  # flex / fa4 compile per shape: at 1M only
    dense = best_dense(qd, kv["k"], kv["v"], paged=True, timer=graph_timer(), only=only)
    t_dense = dense.times_ms[dense.winner]
    report.row("dense_candidates", **candidate_row(f"decode {context} x {batch}", dense))
    kv.clear()
    torch.cuda.empty_cache()
    index_bytes = batch * context * HKI * DI * 2
    index8_bytes = batch * context * HKI * (DI + 4)
    kv_sel_bytes = batch * HKV * TOP_K * P * D * 2 * 2
    dense_bytes = batch * context * HKV * D * 2 * 2
    bw = ceil["copy_tbps"] * 1e12
    tag = OTHER_SCAN_TAG
    other = {f"indexer_fp8_{tag}_ms": t_idx8o, f"indexer_fp8_{tag}_tbps": index8_bytes / t_idx8o / 1e9,
             f"step_fp8_{tag}_ms": t_step8o, f"speedup_fp8_{tag}": t_dense / t_step8o,
             f"{tag}_same_rows": same_rows, f"indexer_{OTHER_KEY_LOAD}_ms": t_idxl,
             f"indexer_{OTHER_KEY_LOAD}_tbps": index_bytes / t_idxl / 1e9,
             f"step_{OTHER_KEY_LOAD}_ms": t_stepl, f"speedup_{OTHER_KEY_LOAD}": t_dense / t_stepl}
    report.row("decode", context=context, batch=batch, dense_ms=t_dense, dense_winner=dense.winner,
               dense_flash_forced_ms=dense.times_ms.get("sdpa_flash", float("nan")),
               dense_tbps=dense_bytes / t_dense / 1e9,
               indexer_ms=t_idx, indexer_tbps=index_bytes / t_idx / 1e9, indexer_fp8_ms=t_idx8,
               indexer_fp8_tbps=index8_bytes / t_idx8 / 1e9, sparse_ms=t_sparse, step_ms=t_step,
               step_fp8_ms=t_step8, naive_ms=t_naive, speedup=t_dense / t_step, speedup_fp8=t_dense / t_step8,
               floor_ms=(index_bytes + kv_sel_bytes) / bw * 1e3,
               floor_fp8_ms=(index8_bytes + kv_sel_bytes) / bw * 1e3, dense_floor_ms=dense_bytes / bw * 1e3,
               **other)
    if batch == 8:
        report.plot.setdefault("decode", {}).setdefault("MSA (bf16 index)", {"tokens": [], "ms": []})
        for name, t in (("MSA (bf16 index)", t_step), ("MSA (fp8 index)", t_step8), ("best dense", t_dense)):
            series = report.plot["decode"].setdefault(name, {"tokens": [], "ms": []})
            series["tokens"].append(context)
            series["ms"].append(t)


# ---------------------------------------------------------------- prefill


def useful_attention_flops(selected: torch.Tensor, positions: torch.Tensor) -> float:
    """4·D·G · Σ over (query, KV head, selected block) of the keys ≤ t in the block."""
    blocks = selected.long()
    keys = (positions[:, None, None] - blocks * P + 1).clamp(min=0, max=P)
    keys = torch.where(blocks >= 0, keys, 0)
    return 4.0 * D * (HQ // HKV) * float(keys.sum())


def _prefill_chunk(report: Report, c: dict, tables: torch.Tensor, start: int, context: int, reps: int,
                   flex_frame: FlexMSA | None, totals: dict) -> None:
    """Time one 16K-token chunk at positions start.. (indexer, sparse attention, flex, naive)."""
    cu = torch.tensor([0, CHUNK], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([start + CHUNK], dtype=torch.int32, device="cuda")
    q = torch.randn(CHUNK, HQ, D, device="cuda", dtype=BF16)
    q_index = index_queries(CHUNK, start)
    warm = 1 if start == 0 else 0

    def indexer() -> torch.Tensor:
        return TRITON.indexer_prefill(q_index, c["index"], tables, seq_lens, cu, TOP_K, N_INIT)

    def sparse() -> torch.Tensor:
        return TRITON.sparse_prefill(q, c["k"], c["v"], tables, seq_lens, cu, selected)

    selected = indexer()
    totals["chunks"].append(dict(q=q, q_index=q_index, seq_lens=seq_lens, cu=cu, selected=selected))
    t_idx = time_ms(indexer, reps=reps, warmup=warm)
    t_sp = time_ms(sparse, reps=reps, warmup=warm)
    positions = torch.arange(start, start + CHUNK, device="cuda")
    totals["useful_flops"] += useful_attention_flops(selected, positions)
    totals["indexer_ms"] += t_idx
    totals["sparse_ms"] += t_sp
    totals["cumulative"].append((start + CHUNK, totals["indexer_ms"] + totals["sparse_ms"]))
    last = start + CHUNK == context
    if flex_frame is not None:
        mask, union = flex_frame.block_mask(selected, start)
        q_flex = q.transpose(0, 1)[None].contiguous()  # [1, Hq, Tq, D]
        totals["flex_ms"] += time_ms(lambda: flex(q_flex, c["k_flat"], c["v_flat"], mask), reps=reps,
                                     warmup=1)
        totals["flex_union"].append(union)
        if last:  # flex computes the same output as the KV-block-major kernel
            theirs = flex(q_flex, c["k_flat"], c["v_flat"], mask)[0].transpose(0, 1)
            totals["flex_max_abs_diff"] = float((sparse().float() - theirs.float()).abs().max())
    if last and context == 131072 and EXPLORE:
        _profile(lambda: (indexer(), sparse()), "128K last chunk: indexer + sparse prefill")
    if last and context <= 131072 and EXPLORE:
        def naive_chunk() -> torch.Tensor:
            sel = NAIVE.indexer_prefill(q_index, c["index"], tables, seq_lens, cu, TOP_K, N_INIT)
            return NAIVE.sparse_prefill(q, c["k"], c["v"], tables, seq_lens, cu, sel)

        t_naive = time_ms(naive_chunk, reps=1, warmup=0)
        report.row("naive", op="prefill, last 16K chunk of 128K", naive_ms=t_naive, triton_ms=t_idx + t_sp,
                   speedup=t_naive / (t_idx + t_sp))


def _profile(fn, title: str) -> None:
    """Per-kernel GPU time of one call, printed to the log (where the time goes)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"--- profile: {title}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def bench_prefill(report: Report, context: int, reps: int, flex_frame: FlexMSA | None) -> dict:
    """Chunked MSA prefill of one `context`-token sequence, 16K-token chunks as the engine runs it."""
    num_pages = context // P
    tables = torch.randperm(num_pages, device="cuda").to(torch.int32)[None]
    c = paged_caches(num_pages)
    if flex_frame is not None:  # contiguous copies in logical order, for flex only
        for name in ("k", "v"):
            pages = c[name][tables[0].long()]
            c[f"{name}_flat"] = pages.reshape(1, context, HKV, D).transpose(1, 2).contiguous()
    totals = {"indexer_ms": 0.0, "sparse_ms": 0.0, "flex_ms": 0.0, "useful_flops": 0.0, "flex_union": [],
              "cumulative": [], "chunks": []}
    for start in range(0, context, CHUNK):
        _prefill_chunk(report, c, tables, start, context, reps, flex_frame, totals)
    _time_pipelined(c, tables, totals, reps)
    c.clear()
    torch.cuda.empty_cache()
    return totals


def _time_pipelined(c: dict, tables: torch.Tensor, totals: dict, reps: int) -> None:
    """Every chunk back to back, as the engine runs them (no host wait between ops or chunks):
    `pipelined_ms` = indexer + sparse attention of each chunk in turn; `sparse_pipelined_ms` = the
    sparse attention of every chunk (selections given). Per-op timings above start each op on an
    idle GPU, so they also count the host's launch time of the sparse path's small ops."""
    chunks = totals.pop("chunks")

    def whole() -> None:
        for ch in chunks:
            sel = TRITON.indexer_prefill(ch["q_index"], c["index"], tables, ch["seq_lens"], ch["cu"], TOP_K,
                                         N_INIT)
            TRITON.sparse_prefill(ch["q"], c["k"], c["v"], tables, ch["seq_lens"], ch["cu"], sel)

    def sparse_all(tile_dense_share: float | None = None) -> None:
        """The sparse prefill op on every chunk; with a share, the tile-dense experiment instead."""
        for ch in chunks:
            args = (ch["q"], c["k"], c["v"], tables, ch["seq_lens"], ch["cu"], ch["selected"])
            if tile_dense_share is None:
                TRITON.sparse_prefill(*args)
            else:
                sparse_prefill_tile_dense(*args, tile_dense_share)

    for ch in chunks:
        ch["args"] = (c["k"], c["v"], tables, ch["seq_lens"], ch["cu"])

    totals["pipelined_ms"] = time_ms(whole, reps=reps, warmup=0)
    totals["sparse_pipelined_ms"] = time_ms(sparse_all, reps=reps, warmup=0)
    if len(chunks) <= 8 and EXPLORE:  # exploration: 128-row sub-tiles per work item (committed: 8)
        from msaserve.kernels.sparse_prefill import triton as spre

        committed = spre._queries_per_item
        variants = {8: totals["sparse_pipelined_ms"]}
        try:
            for subtiles in (4, 16):
                spre._queries_per_item = lambda group, n=subtiles: max(1, n * 128 // group)
                variants[subtiles] = time_ms(sparse_all, reps=reps, warmup=1)
        finally:
            spre._queries_per_item = committed
        totals["subtile_variants_ms"] = variants
        totals["tile_dense"] = _tile_dense_variants(chunks, sparse_all, reps)
    chunks.clear()


def _tile_dense_variants(chunks: list, sparse_all, reps: int) -> dict:
    """The tile-dense experiment (tile_dense.py: common blocks of each tile of consecutive queries
    computed flash-attention style, the rest KV-block-major) against the default, same chunks: all
    chunks' sparse ms, partials the merge reads per (query, KV head) on the last chunk, and the last
    chunk's max |difference| from the default output. A failing variant leaves a note, not a lost
    section."""

    last = chunks[-1]
    seq = torch.zeros(CHUNK, dtype=torch.int64, device="cuda")
    want = TRITON.sparse_prefill(last["q"], *last["args"], last["selected"]).float()
    out = {}
    for share in (0.375, 0.5, 0.75):  # 3.9 / 5.3 / 8.2 partials, +34 / 19 / 5 % MMA (msa_coselection)
        try:
            ms = time_ms(lambda s=share: sparse_all(s), reps=reps, warmup=1)
            got = sparse_prefill_tile_dense(last["q"], *last["args"], last["selected"], share)
            plan = plan_tiles(last["selected"], seq, last["args"][2].shape[1], queries_per_tile(HQ // HKV),
                              share)
            out[share] = {"sparse_ms": ms, "max_abs_diff": float((got.float() - want).abs().max()),
                          "partials_per_query_head": float((plan[4] >= 0).float().sum(-1).mean())}
            _profile(lambda s=share: sparse_prefill_tile_dense(last["q"], *last["args"], last["selected"], s),
                     f"128K last chunk: sparse prefill, tile_dense_share={share}")
        except Exception as exc:  # an exploration variant failing must not lose the measured section
            out[share] = {"error": repr(exc)}
            traceback.print_exc()
    return out


def dense_prefill_choice(report: Report, context: int) -> Choice:
    """Every dense candidate on full causal attention over `context` tokens (dense_baseline.py)."""
    t = {"q": torch.randn(1, HQ, context, D, device="cuda", dtype=BF16),
         "k": torch.randn(1, HKV, context, D, device="cuda", dtype=BF16),
         "v": torch.randn(1, HKV, context, D, device="cuda", dtype=BF16)}
    # At 256K only the candidates that can win there (sdpa_efficient ran 3x slower than the winner
    # at 128K and 256K, flex 1.6x at 16K, in bench_dense.py at dd9cf51): a minute of GPU time less.
    only = {"sdpa_default", "sdpa_cudnn", "sdpa_flash", "fa4"} if context > 131072 else None
    choice = best_dense(t["q"], t["k"], t["v"], reps=2, only=only)
    t.clear()
    torch.cuda.empty_cache()
    best = choice.times_ms[choice.winner]
    report.row("dense_candidates", **candidate_row(f"causal {context}", choice))
    report.row("dense_prefill", context=context, best_ms=best, winner=choice.winner,
               tflops=2 * 2 * HQ * D * context * context / 2 / (best * 1e-3) / 1e12,
               flash_forced_ms=choice.times_ms.get("sdpa_flash", float("nan")))
    return choice


def dense_1m_ms(report: Report, winner: str, at_256k_ms: float, measure: bool) -> tuple[float, str]:
    """Dense causal prefill of 1M tokens: the 256K winner run once at 1M (measure=True: ~30 s of GPU
    time), else the 256K time x 16 (causal cost grows as T²)."""
    if not measure:
        return at_256k_ms * 16, f"extrapolated: {winner} at 256K x 16 (cost ∝ T²)"
    t = {"q": torch.randn(1, HQ, 1 << 20, D, device="cuda", dtype=BF16),
         "k": torch.randn(1, HKV, 1 << 20, D, device="cuda", dtype=BF16),
         "v": torch.randn(1, HKV, 1 << 20, D, device="cuda", dtype=BF16)}
    # One timed call, no warm-up: the kernel already ran at 256K (a compiled candidate recompiles
    # for the new shape, so those get the selector's usual warm-up call).
    single = (lambda name, fn: time_ms(fn, reps=1, warmup=0)) if winner.startswith("sdpa") else None
    choice = best_dense(t["q"], t["k"], t["v"], only={winner}, timer=single, reps=1)
    t.clear()
    torch.cuda.empty_cache()
    ms = choice.times_ms[winner]
    report.row("dense_candidates", **candidate_row(f"causal {1 << 20} (256K winner only)", choice))
    report.notes.append(f"dense 1M causal: {winner} measured once at 1M, {ms:.0f} ms; the 256K time x 16 "
                        f"would be {at_256k_ms * 16:.0f} ms")
    return ms, f"measured: {winner} (the 256K winner), one call at 1M"


def indexer_flops(context: int) -> float:
    """The prefill indexer's causal GEMM over the whole prefill: each query against the keys of its
    blocks up to its own (until 2026-12-05 this counted keys to each chunk's end: 12 % more at 128K,
    1.5 % at 1M, so the msa_floor_ms of earlier runs is that much higher)."""
    return indexer_causal_flops(0, context, P, HKV, DI)


def section(name: str, fn, report: Report) -> None:
    started = time.time()
    try:
        fn()
    except Exception as exc:  # a failed section is reported, the others still run
        report.notes.append(f"section {name} failed: {exc!r}")
        traceback.print_exc()
    print(f"[{name}] {time.time() - started:.1f}s", flush=True)


def run_prefill(report: Report, ceil: dict, skip_1m: bool, measure_1m_dense: bool) -> None:
    dense = {n: dense_prefill_choice(report, n) for n in (16384, 131072, 262144)}
    best = {n: c.times_ms[c.winner] for n, c in dense.items()}
    r = bench_prefill(report, 131072, reps=3, flex_frame=FlexMSA(HKV, CHUNK, 131072, HQ // HKV, P) if EXPLORE
                      else None)
    _prefill_128k_figures(report, ceil, r, dense[131072])
    report.plot["prefill"] = {"best dense (measured)": {"tokens": list(best), "ms": list(best.values())}}
    if skip_1m:
        return
    r1 = bench_prefill(report, 1 << 20, reps=1, flex_frame=None)
    msa1 = r1["pipelined_ms"]
    dense1, dense1_method = dense_1m_ms(report, dense[262144].winner, best[262144], measure_1m_dense)
    floor1 = (indexer_flops(1 << 20) + r1["useful_flops"]) / (ceil["gemm_tflops"] * 1e12) * 1e3
    report.row("prefill", context=1 << 20, dense_ms=dense1, msa_ms=msa1, indexer_ms=r1["indexer_ms"],
               sparse_ms=r1["sparse_ms"], ops_sum_ms=r1["indexer_ms"] + r1["sparse_ms"],
               sparse_pipelined_ms=r1["sparse_pipelined_ms"], flex_ms=float("nan"), speedup=dense1 / msa1,
               msa_floor_ms=floor1, dense_note=dense1_method)
    flash1 = dense[262144].times_ms.get("sdpa_flash", float("nan")) * 16
    report.metric("prefill_speedup_1m_vs_best_dense", dense1 / msa1, "x", ">= 30", msa_ms=msa1,
                  best_dense_ms=dense1, dense_winner=dense[262144].winner, dense_method=dense1_method,
                  msa_floor_ms=floor1, ratio_vs_flash_forced_history=flash1 / msa1,
                  flash_forced_ms_extrapolated=flash1)
    tokens, ms = zip(*r1["cumulative"], strict=True)
    report.plot["prefill"]["MSA (indexer + sparse, 16K chunks)"] = {"tokens": list(tokens), "ms": list(ms)}
    report.plot["prefill"]["best dense (1M: " + dense1_method.split(":")[0] + ")"] = {
        "tokens": [262144, 1 << 20], "ms": [best[262144], dense1]}


def _prefill_128k_figures(report: Report, ceil: dict, r: dict, dense: Choice) -> None:
    msa, best = r["pipelined_ms"], dense.times_ms[dense.winner]
    flash = dense.times_ms.get("sdpa_flash", float("nan"))
    floor = (indexer_flops(131072) + r["useful_flops"]) / (ceil["gemm_tflops"] * 1e12) * 1e3
    report.row("prefill", context=131072, dense_ms=best, msa_ms=msa, indexer_ms=r["indexer_ms"],
               sparse_ms=r["sparse_ms"], ops_sum_ms=r["indexer_ms"] + r["sparse_ms"],
               sparse_pipelined_ms=r["sparse_pipelined_ms"], flex_ms=r["flex_ms"] or float("nan"),
               speedup=best / msa, msa_floor_ms=floor, dense_note=f"measured, {dense.winner}")
    for subtiles, ms in r.get("subtile_variants_ms", {}).items():
        report.row("sparse_prefill_item_size", context=131072, subtiles_per_item=subtiles, sparse_ms=ms,
                   useful_tflops=r["useful_flops"] / (ms * 1e-3) / 1e12)
    tile_dense_tflops = {}
    for share, v in r.get("tile_dense", {}).items():
        if "error" in v:
            report.notes.append(f"tile_dense_share={share} failed: {v['error']}")
            continue
        tile_dense_tflops[share] = r["useful_flops"] / (v["sparse_ms"] * 1e-3) / 1e12
        report.row("sparse_prefill_tile_dense", context=131072, tile_dense_share=share,
                   sparse_ms=v["sparse_ms"], useful_tflops=tile_dense_tflops[share],
                   block_major_ms=r["sparse_pipelined_ms"], ratio=r["sparse_pipelined_ms"] / v["sparse_ms"],
                   partials_per_query_head=v["partials_per_query_head"], max_abs_diff=v["max_abs_diff"])
    report.metric("prefill_speedup_128k_vs_best_dense", best / msa, "x", ">= 12",
                  msa_ms=msa, best_dense_ms=best, dense_winner=dense.winner, msa_floor_ms=floor,
                  dense_candidates_ms=dense.times_ms, ratio_vs_flash_forced_history=flash / msa,
                  msa_ops_timed_apart_ms=r["indexer_ms"] + r["sparse_ms"],
                  method="msa_ms: the 8 chunks back to back (indexer + sparse each), one event pair")
    if r["flex_union"]:
        report.metric("sparse_prefill_vs_flex", r["flex_ms"] / r["sparse_ms"], "x", ">= 1.5",
                      flex_ms=r["flex_ms"], sparse_ms=r["sparse_ms"],
                      flex_union_blocks_per_tile=sum(r["flex_union"]) / len(r["flex_union"]),
                      max_abs_diff_vs_flex=r.get("flex_max_abs_diff"))
    useful_tflops = r["useful_flops"] / (r["sparse_pipelined_ms"] * 1e-3) / 1e12
    report.metric("sparse_prefill_useful_tflops", useful_tflops, "TFLOP/s",
                  ">= 300", useful_flops=r["useful_flops"], sparse_pipelined_ms=r["sparse_pipelined_ms"],
                  per_chunk_timed_apart_tflops=r["useful_flops"] / (r["sparse_ms"] * 1e-3) / 1e12,
                  gemm_ceiling_tflops=ceil["gemm_tflops"], tile_dense_share=None,
                  tile_dense_useful_tflops=tile_dense_tflops)


def run_decode(report: Report, ceil: dict) -> None:
    for context, batch, naive in ((1 << 20, 8, False), (131072, 8, EXPLORE), (32768, 8, False),
                                  (262144, 8, False), (131072, 32, False), (131072, 64, False)):
        section(f"decode {context}x{batch}", lambda c=context, b=batch, n=naive: bench_decode(
            report, ceil, c, b, naive=n), report)
    rows = {(r["context"], r["batch"]): r for r in report.tables.get("decode", [])}
    if (1 << 20, 8) in rows:
        r = rows[(1 << 20, 8)]
        report.metric("indexer_decode_tbps", r["indexer_tbps"], "TB/s", ">= 3.6",
                      copy_ceiling_tbps=ceil["copy_tbps"], fp8_tbps=r["indexer_fp8_tbps"])
        history = {"dense_flash_forced_ms": r["dense_flash_forced_ms"], "dense_winner": r["dense_winner"]}
        report.metric("decode_speedup_1m_vs_best_dense", r["speedup"], "x", ">= 7 (bf16 index)",
                      step_ms=r["step_ms"], best_dense_ms=r["dense_ms"],
                      floor_speedup=r["dense_ms"] / r["floor_ms"],
                      ratio_vs_flash_forced_history=r["dense_flash_forced_ms"] / r["step_ms"], **history)
        report.metric("decode_speedup_1m_fp8_vs_best_dense", r["speedup_fp8"], "x", ">= 12 (fp8 index)",
                      step_ms=r["step_fp8_ms"], best_dense_ms=r["dense_ms"],
                      ratio_vs_flash_forced_history=r["dense_flash_forced_ms"] / r["step_fp8_ms"], **history,
                      floor_speedup=r["dense_ms"] / r["floor_fp8_ms"], fp8_scan=DEFAULT_FP8_SCAN,
                      other_scan=OTHER_FP8_SCAN, other_scan_speedup=r[f"speedup_fp8_{OTHER_SCAN_TAG}"],
                      other_scan_indexer_tbps=r[f"indexer_fp8_{OTHER_SCAN_TAG}_tbps"])
    for (context, batch), r in rows.items():
        if context == 131072:
            report.metric(f"decode_speedup_128k_b{batch}_vs_best_dense", r["speedup"], "x", "report",
                          speedup_fp8=r["speedup_fp8"], best_dense_ms=r["dense_ms"],
                          dense_winner=r["dense_winner"],
                          step_ms=r["step_ms"], step_fp8_ms=r["step_fp8_ms"])


def autotuned_configs() -> dict:
    """The config each autotuned kernel picked per shape key (for the notes)."""
    from msaserve.kernels.indexer_decode import triton as idec
    from msaserve.kernels.indexer_prefill import triton as ipre
    from msaserve.kernels.sparse_decode import triton as sdec
    from msaserve.kernels.sparse_prefill import triton as spre

    kernels = {"indexer_decode": idec._score_split_kernel, "indexer_prefill": ipre._indexer_prefill_kernel,
               "sparse_decode": sdec._sparse_decode_kernel, "sparse_prefill": spre._block_major_kernel}
    return {name: {str(key): str(cfg) for key, cfg in getattr(k, "cache", {}).items()}
            for name, k in kernels.items()}

CASES = Path(__file__).resolve().parents[1] / "data" / "msa_prefill_benchmark_cases_v1.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--git-revision", default="unknown")
    parser.add_argument("--skip-1m-prefill", action="store_true")
    parser.add_argument("--no-explore", action="store_true",
                        help="headline figures only: no naive ops, profiles, flex or A/B kernel variants")
    parser.add_argument("--measure-1m-dense", action="store_true",
                        help="run the 256K dense winner once at 1M (~30 s) instead of extrapolating x16")
    parser.add_argument("--only", default="ceil,decode,prefill,production")
    parser.add_argument("--cases", type=Path, default=CASES)
    args = parser.parse_args()
    torch.manual_seed(0)
    global EXPLORE
    EXPLORE = not args.no_explore
    command = "python benchmarks/kernels/bench_msa.py " + " ".join(sys.argv[1:])
    report = Report(command, torch.cuda.get_device_name(), args.git_revision)
    ceil = {"copy_tbps": 4.27, "gemm_tflops": 686.0}

    def ceilings() -> None:
        ceil.update(copy_tbps=copy_bandwidth_tbps(), gemm_tflops=gemm_tflops())
        report.row("ceilings", copy_tbps=ceil["copy_tbps"], bf16_gemm_tflops=ceil["gemm_tflops"])

    steps = {"ceil": ceilings, "decode": lambda: run_decode(report, ceil),
             "prefill": lambda: run_prefill(report, ceil, args.skip_1m_prefill, args.measure_1m_dense),
             "production": lambda: bench_production(report, TRITON, args.cases)}
    for name in args.only.split(","):
        section(name, steps[name], report)
        report.raw["fa4_installed"] = fa4_available()
        report.raw["autotuned"] = autotuned_configs()
        report.write(args.out)
    report.print_tables()


if __name__ == "__main__":
    main()
