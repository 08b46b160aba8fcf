"""One layer-step of sparse residency's own work, before and after it moved onto the device.

M3 shapes (P 128, Hkv 4, D 128, bf16: 256 KiB pages; top-16 per KV head, so 64 selected entries),
random selections over `--pages` pages as a random-weight model makes them (~all new each step),
a working set of `--budget` of the pages. Per layer-step:
- **before** (git 01eeb5a's `ResidentSession.make_resident`): `torch.unique(...).tolist()` (the host
  reads the selection: a device sync), `residency.WorkingSet.admit` in numpy, the misses copied page
  by page from the pinned host tier, the slot table updated from host lists;
- **after**: `DeviceWorkingSet.admit` (`kernels/residency`: one Triton program on CUDA) and one
  `kernels/page_gather` launch reading the misses from the pinned host tier through a UVA view; the
  host never sees the selection.
Each path's result is checked: the selected pages' K/V in their slots equal the host tier's.

    python benchmarks/kvcache/profile_residency_step.py                  # CPU
    python benchmarks/kvcache/profile_residency_step.py --device cuda    # GPU (UVA view of pinned memory)
"""

import argparse
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from adopt import git_revision, hardware, merge_results  # noqa: E402

from msaserve.engine.kv.device_working_set import DeviceWorkingSet  # noqa: E402
from msaserve.engine.kv.residency import WorkingSet  # noqa: E402
from msaserve.kernels.page_gather import gather_pages, host_view  # noqa: E402

P, HKV, D, TOP_K, RING = 128, 4, 128, 16, 2


def selections(pages: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """[1, 1, Hkv, K] per step: K distinct pages per head, the newest page always among them."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        sel = torch.stack([torch.randperm(pages - 1, generator=gen)[: TOP_K - 1] for _ in range(HKV)])
        out.append(torch.cat([sel, torch.full((HKV, 1), pages - 1)], 1)[None, None])
    return out


def before(host, pool, table, working: WorkingSet, selected: torch.Tensor, step: int, device,
           mark) -> None:
    pages = torch.unique(selected[selected >= 0]).tolist()
    filled = working.admit(pages, step)
    new_pages, slots = [p for p, _ in filled], [s for _, s in filled]
    index = torch.as_tensor(new_pages, device=device, dtype=torch.long)
    table[index] = torch.as_tensor(slots, dtype=torch.int32, device=device)
    mark()
    if device.type == "cuda":
        for page, slot in filled:
            pool[slot].copy_(host[page], non_blocking=True)
    elif filled:
        pool[torch.as_tensor(slots)] = host[torch.as_tensor(new_pages)]


def after(source, pool, working: DeviceWorkingSet, selected: torch.Tensor, step: int, mark) -> None:
    dst, src = working.admit(0, selected, step)
    mark()
    gather_pages(pool, dst, source, src)


def check(host, pool, table: torch.Tensor, selected: torch.Tensor) -> bool:
    pages = torch.unique(selected[selected >= 0]).long()
    slots = table[pages.to(table.device)].long()
    return bool(torch.equal(pool[slots].cpu(), host[pages.cpu()]))


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    host = torch.randn(args.pages, 2, P, HKV, D).to(torch.bfloat16)
    if device.type == "cuda":
        host = host.pin_memory()
    source = host if device.type == "cpu" else host_view(host, device)
    if source is None:
        raise SystemExit("no UVA view of pinned memory on this device")
    sels = [s.to(device) for s in selections(args.pages, args.steps + 10)]
    result = {}
    for name in ("before", "after"):
        pool = torch.zeros(args.budget, 2, P, HKV, D, dtype=torch.bfloat16, device=device)
        if name == "before":
            working = WorkingSet(args.budget, RING)
            table = torch.zeros(args.pages, dtype=torch.int32, device=device)
            working.place_write_page(args.pages - 1)
            table[args.pages - 1] = (args.pages - 1) % RING
        else:
            working = DeviceWorkingSet(1, args.budget, RING, args.pages, device)
            working.place_write_page(args.pages - 1)
            table = working.table(0)[0]
        pool[(args.pages - 1) % RING] = host[args.pages - 1].to(device)
        times, admits, ok = [], [], True
        marks: list[float] = []

        def mark(marks: list[float] = marks) -> None:  # the admission's end (synchronised)
            sync()
            marks.append(time.perf_counter())

        for step, selected in enumerate(sels, start=1):
            sync()
            t0 = time.perf_counter()
            if name == "before":
                before(host, pool, table, working, selected, step, device, mark)
            else:
                after(source, pool, working, selected, step, mark)
            sync()
            if step > 10:  # the first steps warm up (compiles, allocator)
                times.append(time.perf_counter() - t0)
                admits.append(marks[-1] - t0)
            if step % 25 == 0:
                ok &= check(host, pool, table, selected)
        result[name] = dict(us=statistics.median(times) * 1e6, admit_us=statistics.median(admits) * 1e6,
                            ok=ok)
    result["misses"] = float(working.fetched.sum()) / len(sels)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--pages", type=int, default=8192, help="session pages (8192: 1M tokens)")
    parser.add_argument("--budget", type=int, default=819, help="working-set slots (819: 10 %% of 8192)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--output",
                        default=str(ROOT / "benchmarks" / "results" / "kvcache_residency_step.json"))
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (a shared machine: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    r = run(args)
    device = torch.device(args.device)
    tag = "gpu" if device.type == "cuda" else "cpu"
    meta = dict(command="python benchmarks/kvcache/profile_residency_step.py " + " ".join(sys.argv[1:]),
                hardware=hardware(device), date=datetime.now(UTC).isoformat(timespec="seconds"),
                git_revision=os.environ.get("MSASERVE_GIT_REVISION") or git_revision(),
                workload=f"one layer-step, M3 pages (256 KiB bf16), 64 selected entries of "
                f"{args.pages} pages, {args.budget} slots, random selections "
                f"({r['misses']:.1f} misses per step)")
    entries = {
        f"kvcache.residency_step_{name}_us_{tag}": dict(
            value=round(r[name]["us"], 1), unit="us",
            note=f"of which admission {r[name]['admit_us']:.1f} us; contents checked: {r[name]['ok']}")
        for name in ("before", "after")
    }
    for entry in entries.values():
        entry.update(meta)
    out = merge_results(args.output, entries)
    print(f"\n{meta['workload']}; {meta['hardware']}; results → {out}")
    print(f"{'path':<10}{'us / layer-step':>17}{'admission us':>14}{'pages right':>13}")
    for name in ("before", "after"):
        print(f"{name:<10}{r[name]['us']:>17.1f}{r[name]['admit_us']:>14.1f}{r[name]['ok']!s:>13}")


if __name__ == "__main__":
    main()
