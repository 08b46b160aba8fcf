"""Issue 34's multi-GPU run in one call per machine kind: every figure of the issue from one spawn of
one process per GPU (NCCL), printing a table last and writing benchmarks/results/multigpu_run.json.

1. **Collectives** (an nccl-tests-style sweep through `torch.distributed`, message sizes
   `--sweep-mib`): all-reduce and all-to-all over every rank (bus bandwidth: all-reduce × 2(n-1)/n,
   all-to-all × (n-1)/n of the algorithm bandwidth), and rank 0 → rank 1 send/recv (the link).
2. **Layouts**: `m3-mini` (random weights, seed 0, `--layers`) at TP 1 (rank 0 alone), TP 2 and EP 2,
   and with four ranks TP 4, EP 4 and TP 2 × EP 2 (the replica's layers, `engine/parallel/`), each
   rank its own `LLMEngine` over its shard, as the CPU equivalence tests run them:
   - greedy tokens of three prompts against TP 1's;
   - the decode step time of a batch of `--batch` requests at `--context` tokens, median of `--steps`
     engine steps (CUDA graphs where the engine captures them), and its scaling against TP 1;
   - the step's all-reduce / all-to-all / all-gather: bytes per step (counted on one eager step) and
     time per step (the NCCL kernels under the profiler over the replayed steps; on the CPU the calls'
     wall time), their bandwidth against the sweep's at that size and against the link.
3. **Session move**: rank 0 prefills a `--session-len`-token session (TP 1) and sends it to rank 1
   (`parallel/moves.py`: NCCL send/recv device to device, index first, then each layer's K and V);
   rank 1 decodes the next token from it: time to that token, GB/s, and tokens equal to rank 0's own
   next token. Against it, the host-staged move of the same bytes on the same machine: rank 0's copy
   into pinned host memory (index first), then rank 1's copy from pinned host memory into its caches,
   one after the other, and rank 1's step; the two processes' host buffers are not shared, so the
   host-staged bytes rank 1 copies are not rank 0's (the direct move's tokens are the check of the
   content) and the handoff between them (shared memory on one node) is not timed.

Keys (issue 34's done-when): `multigpu.tp2_tokens_equal`, `multigpu.decode_scaling_tp2`,
`multigpu.alltoall_fraction_of_link`, `multigpu.session_move_gbps`, `multigpu.session_move_vs_host_staged`,
with others beside them. `--device cpu` runs the same code on gloo ranks at small widths (a check of
the script, which CI runs): its keys end in `_cpu` and go to multigpu_run_cpu.json.

    python benchmarks/multigpu/run_multigpu.py                            # every GPU of the machine
    python benchmarks/multigpu/run_multigpu.py --device cpu --world 2     # CPU check, gloo
"""

import argparse
import contextlib
import datetime
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "kvcache")]

from adopt import Replica, git_revision, hardware, merge_results, prefill_session  # noqa: E402

from msaserve.engine.config import EngineConfig  # noqa: E402
from msaserve.engine.llm_engine import LLMEngine  # noqa: E402
from msaserve.engine.parallel.comm import build_groups  # noqa: E402
from msaserve.engine.parallel.layout import ParallelLayout  # noqa: E402
from msaserve.engine.parallel.moves import receive_session, send_session  # noqa: E402
from msaserve.engine.parallel.shard import shard_m3_model  # noqa: E402
from msaserve.engine.types import GenerateRequest, SamplingParams  # noqa: E402
from msaserve.kernels import get_ops  # noqa: E402
from msaserve.models.loader import load_model  # noqa: E402
from msaserve.models.presets import M3_MINI_SMALL  # noqa: E402

COLLECTIVES = ("all_reduce", "all_to_all_single", "all_gather")


# ---------------------------------------------------------------- helpers

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def layouts(world: int) -> list[tuple[int, int]]:
    """(tp, ep) of each case: TP 1 first (the reference), then what `world` ranks allow."""
    cases = [(1, 1)]
    if world >= 2:
        cases += [(2, 1), (1, 2)]
    if world >= 4:
        cases += [(4, 1), (1, 4), (2, 2)]
    return cases


def build_model(args: argparse.Namespace, device: torch.device):
    """m3-mini with random weights (seed 0: every rank builds the same model, then keeps its part)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    overrides = dict(num_hidden_layers=args.layers, **(M3_MINI_SMALL if args.small else {}))
    return load_model("m3-mini", device, dtype, "msa", progress=False, seed=0, **overrides).model


def prompt(length: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def timed_op(fn, device: torch.device, iters: int) -> float:
    """Seconds per call of fn, after two untimed calls; every rank of the op calls it alike."""
    for _ in range(2):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) / iters


# ---------------------------------------------------------------- 1. collectives

def sweep(rank: int, world: int, device: torch.device, sizes_mib: list[float], iters: int) -> dict:
    """Bus bandwidth (GB/s) of all-reduce and all-to-all over every rank, and of rank 0 → 1
    send/recv, per message size (bytes)."""
    out: dict[str, list[dict]] = {"all_reduce": [], "all_to_all": [], "send_recv": []}
    for mib in sizes_mib:
        nbytes = int(mib * 2**20) // (4 * world) * 4 * world  # fp32 elements, divisible by the ranks
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        y = torch.empty_like(x)
        dist.barrier()
        t = timed_op(lambda x=x: dist.all_reduce(x), device, iters)
        busbw = nbytes / t * 2 * (world - 1) / world / 1e9
        out["all_reduce"].append(dict(bytes=nbytes, us=t * 1e6, busbw=busbw))
        dist.barrier()
        t = timed_op(lambda x=x, y=y: dist.all_to_all_single(y, x), device, iters)
        out["all_to_all"].append(dict(bytes=nbytes, us=t * 1e6, busbw=nbytes / t * (world - 1) / world / 1e9))
        dist.barrier()
        if rank in (0, 1):  # the link between two GPUs
            t = timed_op(lambda x=x: dist.send(x, 1) if rank == 0 else dist.recv(x, 0), device, iters)
            out["send_recv"].append(dict(bytes=nbytes, us=t * 1e6, busbw=nbytes / t / 1e9))
        dist.barrier()
    return out


def size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def bandwidth_at(rows: list[dict], nbytes: float) -> float:
    """The sweep's bus bandwidth at the size nearest `nbytes` (log scale)."""
    return min(rows, key=lambda r: abs(math.log(r["bytes"] / max(nbytes, 1.0))))["busbw"]


class CountedCollectives:
    """Inside: every torch.distributed collective the layers call is counted (calls, bytes sent by
    this rank) and timed on the host (with a device sync around it when `timed`)."""

    def __init__(self, device: torch.device, timed: bool) -> None:
        self.device, self.timed = device, timed
        self.calls, self.bytes, self.seconds = Counter(), Counter(), Counter()
        self._saved: dict = {}

    def __enter__(self) -> "CountedCollectives":
        for name in COLLECTIVES:
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    def _wrap(self, name: str, fn):
        def counted(*args, **kwargs):
            sent = args[1] if name in ("all_to_all_single", "all_gather") else args[0]
            if self.timed:
                sync(self.device)
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            if self.timed:
                sync(self.device)
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1
            self.bytes[name] += sent.numel() * sent.element_size()
            return result

        return counted


def nccl_kernel_seconds(steps: int, run) -> Counter:
    """Seconds per kind of NCCL kernel over `run()` under the profiler (CUDA graphs included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    seconds: Counter = Counter()
    for event in prof.events():  # (as benchmarks/serving/profile_session_step.py reads kernels)
        name = event.name.lower()
        if event.device_type.name != "CUDA" or "nccl" not in name:
            continue
        kind = ("all_reduce" if "allreduce" in name else "all_gather" if "allgather" in name
                else "all_to_all_single" if ("sendrecv" in name or "alltoall" in name) else "other")
        seconds[kind] += (event.time_range.end - event.time_range.start) / 1e6
    return Counter({k: v / steps for k, v in seconds.items()})


# ---------------------------------------------------------------- 2. layouts

def engine_config(args: argparse.Namespace, device: torch.device, graphs: bool) -> EngineConfig:
    pages = args.batch * (-(-(args.context + args.steps * 3 + 64) // args.page_size)) + 64
    return EngineConfig(model="m3-mini", device=device.type, cuda_graphs=graphs,
                        dtype="bfloat16" if device.type == "cuda" else "float32", attention_backend="msa",
                        num_pages=pages, max_num_seqs=max(args.batch, 3),
                        max_num_batched_tokens=max(args.chunk, 256),
                        max_model_len=args.context + args.steps * 3 + 64)


def run_until_done(engine: LLMEngine, requests: list[GenerateRequest]) -> dict[str, list[int]]:
    for request in requests:
        engine.add_request(request)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
    return tokens


def decode_steps(engine: LLMEngine, args: argparse.Namespace, device: torch.device, vocab: int) -> dict:
    """A batch at `--context` tokens decoding: the step times (median of --steps), the collectives
    of one eager step (calls, bytes) and their time per replayed step."""
    greedy = SamplingParams(max_tokens=args.steps * 3 + 8, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(GenerateRequest(f"b{i}", prompt(args.context, 100 + i, vocab), greedy))
    produced: Counter = Counter()
    for _ in range(100_000):
        if len(produced) == args.batch and min(produced.values()) >= 2:  # every request past its prefill
            break
        for output in engine.step():
            produced[output.request_id] += len(output.token_ids)
    else:
        raise RuntimeError(f"the batch of {args.batch} did not reach its decode steps: {dict(produced)}")
    def timed_steps() -> list[float]:
        times = []
        for _ in range(args.steps):
            sync(device)
            start = time.perf_counter()
            engine.step()
            sync(device)
            times.append(time.perf_counter() - start)
        return times

    times = timed_steps()
    graphs = getattr(engine.runner, "graphs", None)
    engine.runner.graphs = None  # eager steps: the collectives' Python calls run (and are counted)
    try:
        eager = timed_steps() if graphs is not None else times
        with CountedCollectives(device, timed=device.type != "cuda") as counted:
            engine.step()
    finally:
        engine.runner.graphs = graphs
    if device.type == "cuda":
        def run() -> None:
            for _ in range(args.steps):
                engine.step()
            sync(device)
        per_step = nccl_kernel_seconds(args.steps, run)
    else:
        per_step = counted.seconds
    for request_id in list(produced):
        engine.abort(request_id)
    return dict(step_ms=statistics.median(times) * 1e3, step_times_ms=[t * 1e3 for t in times],
                eager_step_ms=statistics.median(eager) * 1e3,
                graphs=graphs is not None, calls=dict(counted.calls), bytes=dict(counted.bytes),
                seconds_per_step=dict(per_step))


def run_layout(args: argparse.Namespace, device: torch.device, tp: int, ep: int, groups) -> dict:
    model = build_model(args, device)
    if tp * ep > 1:
        model = shard_m3_model(model, groups)
    vocab = model.config.vocab_size
    # The EP layers read their all-to-all split sizes on the host: no capture (a failed one would leave
    # an NCCL call half-enqueued on a capturing stream), so EP layouts decode eagerly.
    engine = LLMEngine(engine_config(args, device, graphs=args.graphs and ep == 1), model=model)
    check = SamplingParams(max_tokens=args.check_tokens, temperature=0.0, ignore_eos=True)
    tokens = run_until_done(engine, [GenerateRequest(f"r{i}", prompt(n, 10 + i, vocab), check)
                                     for i, n in enumerate((args.page_size * 3 + 5, 9, 2 * args.page_size))])
    result = dict(tp=tp, ep=ep, tokens=tokens, **decode_steps(engine, args, device, vocab))
    del engine, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------- 3. session move

def session_move(args: argparse.Namespace, rank: int, device: torch.device, pair) -> dict | None:
    """Rank 0's session → rank 1 by NCCL send/recv (index first) and by host staging: rank 1's
    time to the next token, and rank 0's own next token to compare with. pair: the group of ranks 0
    and 1 (the others wait outside)."""
    if rank > 1:
        return None
    model = build_model(args, device)
    ops = get_ops("msa", device)
    page = model.config.page_size
    tokens = prompt(args.session_len, 7, model.config.vocab_size)
    capacity = args.session_len + 2 * page
    pages = -(-args.session_len // page)
    with torch.inference_mode():
        if rank == 0:
            replica, first, prefill_s = prefill_session(model, ops, tokens, capacity, args.chunk)
        else:
            replica, first, prefill_s = Replica(model, capacity, ops), -1, 0.0
        caches = replica.state.caches
        nbytes = sum(t[:pages].numel() * t.element_size() for c in caches
                     for t in (c.index_cache, c.k_cache, c.v_cache, c.index_scale) if t is not None)
        out = dict(pages=pages, bytes=nbytes, prefill_s=prefill_s)
        # direct: NCCL send/recv device to device (gloo on the CPU), index first
        sync(device)
        dist.barrier(group=pair)
        start = time.perf_counter()
        if rank == 0:
            send_session(caches, range(pages), [*tokens, first], dst=1)
            sync(device)
            out["send_s"] = time.perf_counter() - start
            out["token"] = replica.run([first], args.session_len, decode=True)
        else:
            got, table = receive_session(caches, lambda n: range(n), src=0)
            sync(device)
            out["receive_s"] = time.perf_counter() - start
            out["token"] = replica.run([got[-1]], len(got) - 1, decode=True)
            sync(device)
            out["time_to_token_s"] = time.perf_counter() - start
            out["tokens_received"] = len(got) == args.session_len + 1 and table == list(range(pages))
        # host-staged: device → pinned host (rank 0), then pinned host → device (rank 1), one after the other
        pin = device.type == "cuda"
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        views, at = [], 0
        scales = [c.index_scale for c in caches if c.index_scale is not None]
        order = ([c.index_cache for c in caches] + scales  # index first, as the direct move
                 + [t for c in caches for t in (c.k_cache, c.v_cache)])
        for tensor in order:
            part = tensor[:pages]
            size = part.numel() * part.element_size()
            views.append((part, host[at : at + size].view(part.dtype).view(part.shape)))
            at += size
        sync(device)
        dist.barrier(group=pair)
        start = time.perf_counter()
        if rank == 0:
            for part, staged in views:
                staged.copy_(part, non_blocking=pin)
            sync(device)
            out["to_host_s"] = time.perf_counter() - start
        dist.barrier(group=pair)  # rank 1 copies in after rank 0 copied out
        if rank == 1:
            start = time.perf_counter()
            for part, staged in views:
                part.copy_(staged, non_blocking=pin)
            sync(device)
            out["from_host_s"] = time.perf_counter() - start
            replica.run([first if first >= 0 else tokens[-1]], args.session_len, decode=True)
            sync(device)
            out["host_step_s"] = time.perf_counter() - start - out["from_host_s"]
    del replica, model, host, views
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------- the ranks

def rank_main(rank: int, args: argparse.Namespace, port: int, out_dir: str) -> None:
    cuda = args.device == "cuda"
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=args.timeout))
    result: dict = dict(rank=rank, device=hardware(device), sweep={}, layouts={}, move=None)
    if "sweep" in args.parts:
        result["sweep"] = sweep(rank, args.world, device, args.sweep_mib, args.sweep_iters)
    for tp, ep in layouts(args.world) if "layouts" in args.parts else ():
        groups = build_groups(ParallelLayout(tp, ep), rank)  # collective: every rank takes part
        if groups is not None:
            result["layouts"][f"tp{tp}_ep{ep}"] = run_layout(args, device, tp, ep, groups)
        dist.barrier()
    pair = dist.new_group([0, 1])  # collective: every rank takes part
    if "move" in args.parts:
        result["move"] = session_move(args, rank, device, pair)
    dist.barrier()
    with open(Path(out_dir) / f"rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------- report

def report(args: argparse.Namespace, ranks: list[dict]) -> dict:
    r0 = ranks[0]
    sweep_rows = r0["sweep"]
    link = max((row["busbw"] for row in sweep_rows.get("send_recv", [])), default=float("nan"))
    cases = r0["layouts"]
    base = cases.get("tp1_ep1")
    if base is None:  # (--parts without layouts)
        cases = {}
    suffix = "" if args.device == "cuda" else "_cpu"
    meta = dict(
        command="python benchmarks/multigpu/run_multigpu.py " + " ".join(sys.argv[1:]),
        hardware=f"{args.world} × {r0['device']}", gpus=args.world if args.device == "cuda" else 0,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        git_revision=os.environ.get("MSASERVE_GIT_REVISION") or git_revision(),
        workload=f"m3-mini{' (small widths)' if args.small else ''}, {args.layers} layers, random weights; "
        f"decode batch {args.batch} at {args.context} tokens; session {args.session_len} tokens",
    )
    entries: dict[str, dict] = {}
    table = []
    for name, case in cases.items():
        rank_tokens = [r["layouts"][name]["tokens"] for r in ranks if name in r["layouts"]]
        equal = all(t == base["tokens"] for t in rank_tokens)
        # against TP 1 in the same mode: replayed graphs if both captured, else eager steps
        both_graphs = case["graphs"] and base["graphs"]
        scaling = (base["step_ms"] / case["step_ms"] if both_graphs
                   else base["eager_step_ms"] / case["eager_step_ms"])
        per_step = case["seconds_per_step"]
        coll = {}
        for kind, nbytes in case["bytes"].items():
            seconds = per_step.get(kind, 0.0)
            calls = case["calls"][kind]
            rows = sweep_rows.get("all_reduce" if kind == "all_reduce" else "all_to_all")
            gbps = nbytes / seconds / 1e9 if seconds > 0 else float("nan")
            coll[kind] = dict(calls=calls, bytes=nbytes, ms=seconds * 1e3, gbps=gbps,
                              sweep_gbps=bandwidth_at(rows, nbytes / max(calls, 1)) if rows else float("nan"),
                              fraction_of_link=gbps / link if link == link and link > 0 else float("nan"))
        table.append((name, equal, case["step_ms"], scaling, coll))
        if name == "tp1_ep1":
            continue
        label = name.replace("_ep1", "").replace("tp1_", "")  # tp2, ep2, tp2_ep2, ...
        entries[f"multigpu.{label}_tokens_equal{suffix}"] = dict(
            value=equal, unit="bool", note="greedy tokens of 3 prompts on every rank vs TP 1")
        entries[f"multigpu.decode_scaling_{label}{suffix}"] = dict(
            value=round(scaling, 3), unit="x TP 1 step time",
            note=f"decode step {case['step_ms']:.3f} ms vs TP 1 {base['step_ms']:.3f} ms (median of "
            f"{args.steps} engine steps, CUDA graphs: {case['graphs']} / {base['graphs']}); eager steps "
            f"{case['eager_step_ms']:.3f} vs {base['eager_step_ms']:.3f} ms; the scaling compares "
            f"{'replayed' if both_graphs else 'eager'} steps; collectives per step: " + "; ".join(
                f"{k} {v['calls']} calls {size(v['bytes'])} {v['ms']:.3f} ms ({v['gbps']:.3g} GB/s; "
                f"sweep {v['sweep_gbps']:.3g} GB/s at that size)" for k, v in coll.items()))
        fraction_key = f"multigpu.alltoall_fraction_of_link{suffix}"
        if ("all_to_all_single" in coll and label.startswith("ep") and fraction_key not in entries
                and math.isfinite(link)):
            a2a = coll["all_to_all_single"]
            entries[fraction_key] = dict(
                value=round(a2a["fraction_of_link"], 5), unit="fraction",
                note=f"{name}: all-to-all {size(a2a['bytes'])} per decode step in "
                f"{a2a['ms']:.3f} ms = {a2a['gbps']:.3g} GB/s vs the link's {link:.3g} GB/s (rank 0 → 1 "
                f"send/recv peak of the sweep); the sweep's all-to-all bus bandwidth at the step's message "
                f"size {a2a['sweep_gbps']:.3g} GB/s")
    move = r0.get("move")
    moved = ranks[1].get("move") if len(ranks) > 1 else None
    if move and moved:
        direct = moved["time_to_token_s"]
        staged = move["to_host_s"] + moved["from_host_s"] + moved["host_step_s"]
        gbps = move["bytes"] / moved["receive_s"] / 1e9
        equal = moved["token"] == move["token"] and moved["tokens_received"]
        entries[f"multigpu.session_move_gbps{suffix}"] = dict(
            value=round(gbps, 2), unit="GB/s",
            note=f"{args.session_len}-token session, {size(move['bytes'])} (index first, then K/V), "
            f"rank 0 → 1 by send/recv in {moved['receive_s'] * 1e3:.1f} ms; "
            + (f"the link {link:.1f} GB/s ({gbps / link:.2f} of it)" if math.isfinite(link)
               else "the link not measured in this run (--parts without sweep)")
            + f"; next token on rank 1 {direct * 1e3:.1f} ms after the move began; "
            f"its token equals rank 0's: {equal}")
        entries[f"multigpu.session_move_vs_host_staged{suffix}"] = dict(
            value=round(staged / direct, 3), unit="x (host-staged time to token / direct)",
            note=f"host-staged: to pinned host {move['to_host_s'] * 1e3:.1f} ms + from pinned host "
            f"{moved['from_host_s'] * 1e3:.1f} ms + step {moved['host_step_s'] * 1e3:.1f} ms = "
            f"{staged * 1e3:.1f} ms vs direct {direct * 1e3:.1f} ms (one after the other, the handoff "
            "between the processes' host buffers not timed)")
        entries[f"multigpu.session_move_tokens_equal{suffix}"] = dict(value=equal, unit="bool")
    for entry in entries.values():
        entry.update(meta)
    name = "multigpu_run.json" if args.device == "cuda" else "multigpu_run_cpu.json"
    out = merge_results(args.output or ROOT / "benchmarks" / "results" / name, entries)
    print(f"\n{meta['workload']}; {meta['hardware']}; results → {out}")
    print(f"{'collective (sweep)':<22}{'bytes':>12}{'us':>10}{'bus GB/s':>10}")
    for kind, rows in sweep_rows.items():
        for row in rows:
            print(f"{kind:<22}{row['bytes']:>12}{row['us']:>10.1f}{row['busbw']:>10.2f}")
    print(f"\n{'layout':<10}{'tokens eq':>10}{'step ms':>9}{'eager ms':>9}{'scaling':>9}  "
          "collectives per step")
    for name, equal, step_ms, scaling, coll in table:
        eager_ms = cases[name]["eager_step_ms"]
        parts = ", ".join(f"{k} {size(v['bytes'])} {v['ms']:.3f} ms {v['gbps']:.3g} GB/s"
                          for k, v in coll.items())
        print(f"{name:<10}{equal!s:>10}{step_ms:>9.3f}{eager_ms:>9.3f}{scaling:>9.2f}  {parts}")
    if move and moved:
        print(f"\nsession move ({size(move['bytes'])}): direct {direct * 1e3:.1f} ms to token "
              f"({gbps:.3g} GB/s), host-staged {staged * 1e3:.1f} ms ({staged / direct:.2f}x), "
              f"token equal {equal}")
    return entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--world", type=int, default=None, help="ranks (default: every GPU; CPU 2)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--small", action="store_true", help="m3-mini at small widths (default on the CPU)")
    parser.add_argument("--batch", type=int, default=None, help="decode batch (default 8; CPU 2)")
    parser.add_argument("--context", type=int, default=None, help="tokens per request (default 8192; CPU 96)")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps (default 32; CPU 3)")
    parser.add_argument("--check-tokens", type=int, default=8)
    parser.add_argument("--session-len", type=int, default=None, help="default 1048576; CPU 256")
    parser.add_argument("--chunk", type=int, default=None, help="prefill chunk (default 32768; CPU 128)")
    parser.add_argument("--sweep-mib", type=float, nargs="+", default=None)
    parser.add_argument("--sweep-iters", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=600.0, help="collectives' timeout, seconds")
    parser.add_argument("--parts", nargs="+", choices=["sweep", "layouts", "move"],
                        default=["sweep", "layouts", "move"],
                        help="what to run (e.g. one part per device call when calls are short)")
    parser.add_argument("--no-graphs", dest="graphs", action="store_false",
                        help="no CUDA graphs in any layout (by default TP layouts capture, EP ones cannot)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    cpu = args.device == "cpu"
    if not cpu and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu for the gloo check)")
    args.world = args.world or (2 if cpu else torch.cuda.device_count())
    if args.world < 2:
        raise SystemExit(f"--world {args.world}: the run needs at least 2 ranks (GPUs)")
    args.small = args.small or cpu
    args.batch = args.batch or (2 if cpu else 8)
    args.context = args.context or (96 if cpu else 8192)
    args.steps = args.steps or (3 if cpu else 32)
    args.session_len = args.session_len or (256 if cpu else 1 << 20)
    args.chunk = args.chunk or (128 if cpu else 32768)
    args.sweep_mib = args.sweep_mib or ([0.0625, 1.0] if cpu else [0.0625, 0.25, 1, 4, 16, 64, 256])
    args.sweep_iters = args.sweep_iters or (3 if cpu else 20)
    args.page_size = 16 if args.small else 128
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(rank_main, args=(args, free_port(), out_dir), nprocs=args.world, join=True)
        ranks = [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(args.world)]
    with contextlib.suppress(BrokenPipeError):
        report(args, ranks)


if __name__ == "__main__":
    main()
