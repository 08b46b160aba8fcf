"""How strong is the dense baseline's decode? One layer's decode attention at the M3 shape (m3-mini's,
Hq=64, Hkv=4, D=128, P=128, bf16, contexts full), timed four ways in the same run:

  paged      the dense backend's paged flash-decoding kernel (msaserve/kernels/dense/paged_decode.py)
  contiguous SDPA (flash) over K/V already contiguous per sequence: the ideal non-paged dense decode
  gather     the previous dense decode: gather every page into contiguous K/V, then SDPA, per sequence
  msa        MSA's decode: Triton indexer (K=16 blocks) + sparse attention

paged, contiguous and msa are replayed in CUDA graphs (as the engine does); gather cannot be
captured (host syncs) and is timed eagerly. TB/s = the K/V bytes a dense decode must read / time.

    python benchmarks/serving/dense_decode.py            # CUDA only; writes benchmarks/results/engine.json
"""

import argparse
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from report import Report

from msaserve.kernels.dense import sdpa
from msaserve.kernels.dense.paged_decode import dense_decode
from msaserve.kernels.dispatch import get_ops

HQ, HKV, D, DI, P, TOP_K = 64, 4, 128, 128, 128, 16
BF16 = torch.bfloat16
SHAPES = ((1, 65536), (8, 65536), (32, 65536), (1, 1 << 20))  # (batch, context)


def graph_ms(fn: Callable[[], torch.Tensor], reps: int = 20) -> float:
    """Mean time of one replay of `fn` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the graph (compile, autotune)
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _events_ms(graph.replay, reps)


def _events_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def bench_shape(batch: int, context: int) -> dict[str, float]:
    pages = context // P
    num_pages = batch * pages
    tables = torch.randperm(num_pages, device="cuda").to(torch.int32).view(batch, pages)
    c = {"k": torch.randn(num_pages, P, HKV, D, device="cuda", dtype=BF16)}  # caches, freed as we go
    c["v"] = torch.randn_like(c["k"])
    c["index"] = torch.randn(num_pages, P, 1, DI, device="cuda", dtype=BF16)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, 1, HQ, D, device="cuda", dtype=BF16)
    q_index = torch.randn(batch, 1, HKV, DI, device="cuda", dtype=BF16)
    msa = get_ops("triton", "cuda")
    times = {"paged": graph_ms(lambda: dense_decode(q, c["k"], c["v"], tables, seq_lens))}

    def msa_step() -> torch.Tensor:
        selected = msa.indexer_decode(q_index, c["index"], tables, seq_lens, TOP_K, 1)
        return msa.sparse_decode(q, c["k"], c["v"], tables, seq_lens, selected)

    times["msa"] = graph_ms(msa_step)
    times["gather"] = _events_ms(lambda: sdpa.dense_decode(q, c["k"], c["v"], tables, seq_lens), 3)
    # Contiguous K/V [B, Hkv, T, D]; the G query heads of a KV head as G query rows (no K/V expansion).
    del c["index"]
    k = c.pop("k")[tables.long()].permute(0, 3, 1, 2, 4).reshape(batch, HKV, context, D)
    v = c.pop("v")[tables.long()].permute(0, 3, 1, 2, 4).reshape(batch, HKV, context, D)
    qg = q.view(batch, HKV, HQ // HKV, D)
    times["contiguous"] = graph_ms(lambda: F.scaled_dot_product_attention(qg, k, v))
    times["tbps"] = batch * context * HKV * D * 2 * 2 / (times["paged"] * 1e-3) / 1e12
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="benchmarks/results/engine.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("dense_decode.py needs a CUDA GPU", file=sys.stderr)
        return 2
    args.device = "cuda"
    report = Report(args, "M3 attention shape, one layer (Hq=64, Hkv=4, D=128, P=128, bf16)")
    note = "one layer's decode attention, one query per sequence, contexts full; CUDA graphs except gather"
    rows = []
    with torch.inference_mode():
        for batch, context in SHAPES:
            t = bench_shape(batch, context)
            tag = f"b{batch}_{context // 1024}k"
            for name in ("paged", "contiguous", "gather", "msa"):
                report.add(f"decode_attention_{name}_ms_{tag}", t[name], "ms", note=note)
            report.add(f"decode_attention_paged_tbps_{tag}", t["tbps"], "TB/s", note=note)
            rows.append((batch, context, t))
            torch.cuda.empty_cache()
    report.write(args.output)
    print(f"\n{'batch':>5} {'context':>8} {'paged ms':>9} {'TB/s':>6} {'contig ms':>9} {'gather ms':>9} "
          f"{'msa ms':>8} {'paged/msa':>9}")
    for batch, context, t in rows:
        print(f"{batch:>5} {context:>8} {t['paged']:>9.3f} {t['tbps']:>6.2f} {t['contiguous']:>9.3f} "
              f"{t['gather']:>9.3f} {t['msa']:>8.3f} {t['paged'] / t['msa']:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
