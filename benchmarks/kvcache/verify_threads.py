"""How fast the host checks page checksums, by thread count and call form.

Adoption's index load verifies every index page (xxh3_64 of 128 KiB) beside its host→device copy;
on the H200's host 8 threads measured 14.8 GB/s (72.5 ms for 1 GiB), far below the memory's rate,
so the check, not the copy, bounded the load. This measures, over 1 GiB of 128 KiB pages in
ordinary and in pinned memory:
- `oneshot`: `xxhash.xxh3_64_intdigest(page)` (the form the load used),
- `object`: `xxhash.xxh3_64(page).intdigest()` (the hasher object, whose update releases the GIL),
at 1, 2, 4, 8 and all-core threads, 32 pages per task. Prints a table last; writes
benchmarks/results/kvcache_verify_threads.json.

    python benchmarks/kvcache/verify_threads.py [--gib 1] [--repeats 3]
"""

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adopt import git_revision, hardware, merge_results

ROOT = Path(__file__).resolve().parents[2]
PAGE = 128 << 10
TASK_PAGES = 32


def oneshot(views) -> int:
    return sum(xxhash.xxh3_64_intdigest(v) & 1 for v in views)


def hasher(views) -> int:
    return sum(xxhash.xxh3_64(v).intdigest() & 1 for v in views)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    pages = int(args.gib * (1 << 30)) // PAGE
    cuda = torch.cuda.is_available()
    memories = {"pageable": torch.randint(0, 256, (pages, PAGE), dtype=torch.uint8)}
    if cuda:
        memories["pinned"] = memories["pageable"].pin_memory()
    counts = sorted({1, 2, 4, 8, os.cpu_count() or 1})
    rows = []
    for memory, tensor in memories.items():
        array = tensor.numpy()
        views = [array[i] for i in range(pages)]
        tasks = [views[a : a + TASK_PAGES] for a in range(0, pages, TASK_PAGES)]
        for form, fn in (("oneshot", oneshot), ("object", hasher)):
            for threads in counts:
                pool = ThreadPoolExecutor(threads)
                list(pool.map(fn, tasks[:threads]))  # start the threads
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    list(pool.map(fn, tasks))
                    times.append(time.perf_counter() - start)
                pool.shutdown()
                ms = statistics.median(times) * 1e3
                rows.append(dict(memory=memory, form=form, threads=threads, ms=round(ms, 2),
                                 gbps=round(pages * PAGE / 1e9 / (ms / 1e3), 1)))
                print(rows[-1], flush=True)
    device = torch.device("cuda" if cuda else "cpu")
    prefix = "kvcache.verify_threads" if cuda else "kvcache.verify_threads_cpu"
    meta = dict(command="python benchmarks/kvcache/verify_threads.py " + " ".join(sys.argv[1:]),
                hardware=hardware(device) + f", {os.cpu_count()} host cores",
                date=datetime.now(UTC).isoformat(timespec="seconds"),
                git_revision=os.environ.get("MSASERVE_GIT_REVISION") or git_revision(),
                workload=f"xxh3_64 of {pages} pages of 128 KiB ({pages * PAGE / 2**30:.2f} GiB), "
                         f"{TASK_PAGES} pages per task, median of {args.repeats}")
    out = merge_results(ROOT / "benchmarks" / "results" / "kvcache_verify_threads.json",
                        {prefix: dict(value=rows, unit="table", **meta)})
    print(f"\n{meta['workload']}; {meta['hardware']}; results → {out}")
    print(f"{'memory':<10}{'form':<9}{'threads':>8}{'ms':>9}{'GB/s':>8}")
    for r in rows:
        print(f"{r['memory']:<10}{r['form']:<9}{r['threads']:>8}{r['ms']:>9.1f}{r['gbps']:>8.1f}")


if __name__ == "__main__":
    main()
